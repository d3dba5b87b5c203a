/* getnameinfo() that never asks a name server for a host, patched into torch's loaded libraries.
 *
 * torch's c10d formats the address of every socket its TCPStore accepts or connects with
 * getnameinfo(..., NI_NUMERICSERV): a reverse DNS lookup on the store server's event loop, where a
 * lost answer stalls every client of the store for the resolver's timeout. patch() walks the
 * objects the dynamic linker has loaded (dl_iterate_phdr), and in those under the given
 * directories points each relocation slot (GOT entry) of getnameinfo at numeric_getnameinfo,
 * after checking that the slot holds what the linker put there. resilient/native/names.py calls
 * it; slots() shows what a slot holds, for the tests. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <limits.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*getnameinfo_fn)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t,
                              int);

/* The process's getnameinfo as the dynamic linker resolves it; called directly, so no slot that
 * patch() rewrites is on the way. */
static getnameinfo_fn real_getnameinfo;

static int numeric_getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen,
                               char *serv, socklen_t servlen, int flags) {
    /* A caller that requires a name (NI_NAMEREQD) still gets a name or an error, as it asked. */
    if (!(flags & NI_NAMEREQD))
        flags |= NI_NUMERICHOST;
    return real_getnameinfo(sa, salen, host, hostlen, serv, servlen, flags);
}

static PyObject *address(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromVoidPtr((void *)&numeric_getnameinfo);
}

#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__)
enum { JUMP_SLOT = R_X86_64_JUMP_SLOT, GLOB_DAT = R_X86_64_GLOB_DAT };
#else
enum { JUMP_SLOT = R_AARCH64_JUMP_SLOT, GLOB_DAT = R_AARCH64_GLOB_DAT };
#endif

static const char SYMBOL[] = "getnameinfo";

/* What a loaded object's dynamic section says, its addresses made absolute. */
struct image {
    const struct dl_phdr_info *info;
    const ElfW(Sym) *symtab;
    const char *strtab;
    size_t strsz;
    size_t imports; /* symbols [1, imports) are the ones that may be undefined (imported) */
    const ElfW(Rela) *jmprel, *rela;
    size_t jmprel_n, rela_n, relacount;
};

/* glibc has made the dynamic section's addresses absolute in place (x86-64, AArch64) and musl has
 * not: a value below the load bias is still the object's own virtual address. */
static const void *absolute(const struct dl_phdr_info *info, ElfW(Addr) p) {
    return (const void *)(p < info->dlpi_addr ? info->dlpi_addr + p : p);
}

static const ElfW(Dyn) *dynamic_section(const struct dl_phdr_info *info) {
    for (ElfW(Half) i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            return (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    return NULL;
}

/* Fills *im from the object's dynamic section; NULL, or why the object cannot be read. */
static const char *read_image(const struct dl_phdr_info *info, struct image *im) {
    const ElfW(Dyn) *d = dynamic_section(info);
    const uint32_t *gnu_hash = NULL, *sysv_hash = NULL;
    size_t jmprelsz = 0, relasz = 0, relaent = sizeof(ElfW(Rela)), syment = sizeof(ElfW(Sym));
    ElfW(Xword) pltrel = DT_RELA;

    memset(im, 0, sizeof *im);
    im->info = info;
    if (!d)
        return "no dynamic section";
    for (; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
        case DT_SYMTAB: im->symtab = absolute(info, d->d_un.d_ptr); break;
        case DT_STRTAB: im->strtab = absolute(info, d->d_un.d_ptr); break;
        case DT_STRSZ: im->strsz = d->d_un.d_val; break;
        case DT_SYMENT: syment = d->d_un.d_val; break;
        case DT_GNU_HASH: gnu_hash = absolute(info, d->d_un.d_ptr); break;
        case DT_HASH: sysv_hash = absolute(info, d->d_un.d_ptr); break;
        case DT_JMPREL: im->jmprel = absolute(info, d->d_un.d_ptr); break;
        case DT_PLTRELSZ: jmprelsz = d->d_un.d_val; break;
        case DT_PLTREL: pltrel = d->d_un.d_val; break;
        case DT_RELA: im->rela = absolute(info, d->d_un.d_ptr); break;
        case DT_RELASZ: relasz = d->d_un.d_val; break;
        case DT_RELAENT: relaent = d->d_un.d_val; break;
        case DT_RELACOUNT: im->relacount = d->d_un.d_val; break;
        default: break;
        }
    }
    if (!im->symtab || !im->strtab || !im->strsz || syment != sizeof(ElfW(Sym)))
        return "no dynamic symbol table of the expected layout";
    if ((im->jmprel && pltrel != DT_RELA) || relaent != sizeof(ElfW(Rela)))
        return "relocations are not RELA";
    /* Undefined symbols are never in the GNU hash table: linkers order them below its symoffset. */
    if (gnu_hash)
        im->imports = gnu_hash[1];
    else if (sysv_hash)
        im->imports = sysv_hash[1]; /* nchain: every symbol */
    else
        return "no symbol hash table (the symbol table's extent is unknown)";
    im->jmprel_n = im->jmprel ? jmprelsz / sizeof(ElfW(Rela)) : 0;
    im->rela_n = im->rela ? relasz / sizeof(ElfW(Rela)) : 0;
    if (im->relacount > im->rela_n)
        im->relacount = im->rela_n;
    return NULL;
}

static int is_import_of_getnameinfo(const struct image *im, size_t sym) {
    const ElfW(Sym) *s;
    if (sym == 0 || sym >= im->imports)
        return 0;
    s = &im->symtab[sym];
    if (s->st_shndx != SHN_UNDEF || im->strsz < sizeof SYMBOL || s->st_name > im->strsz - sizeof SYMBOL)
        return 0;
    return memcmp(im->strtab + s->st_name, SYMBOL, sizeof SYMBOL) == 0;
}

typedef void (*slot_fn)(const struct image *im, uintptr_t *slot, unsigned type, void *ctx);

static void scan(const struct image *im, const ElfW(Rela) *r, size_t n, slot_fn fn, void *ctx) {
    for (size_t i = 0; i < n; i++) {
        unsigned type = (unsigned)ELF64_R_TYPE(r[i].r_info);
        if ((type == JUMP_SLOT || type == GLOB_DAT) && is_import_of_getnameinfo(im, ELF64_R_SYM(r[i].r_info)))
            fn(im, (uintptr_t *)(im->info->dlpi_addr + r[i].r_offset), type, ctx);
    }
}

/* Calls fn for each slot of getnameinfo: the function-call (JUMP_SLOT) and address-taken
 * (GLOB_DAT) relocations; the leading RELACOUNT entries of DT_RELA are relative ones, skipped. */
static void for_each_slot(const struct image *im, slot_fn fn, void *ctx) {
    if (im->rela)
        scan(im, im->rela + im->relacount, im->rela_n - im->relacount, fn, ctx);
    if (im->jmprel)
        scan(im, im->jmprel, im->jmprel_n, fn, ctx);
}

static const ElfW(Phdr) *segment(const struct dl_phdr_info *info, uintptr_t a, ElfW(Word) type) {
    for (ElfW(Half) i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == type && a - (info->dlpi_addr + ph->p_vaddr) < ph->p_memsz)
            return ph;
    }
    return NULL;
}

/* The protection of the page holding a, as the loader left it: its PT_LOAD's flags, or read-only
 * where PT_GNU_RELRO covers the whole page (glibc and musl round both of its ends down); -1 when a
 * is in no segment. */
static int protection(const struct dl_phdr_info *info, uintptr_t a, uintptr_t page) {
    const ElfW(Phdr) *load = segment(info, a, PT_LOAD);
    if (!load)
        return -1;
    for (ElfW(Half) i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = (info->dlpi_addr + ph->p_vaddr) & ~(page - 1);
        uintptr_t hi = (info->dlpi_addr + ph->p_vaddr + ph->p_memsz) & ~(page - 1);
        if (ph->p_type == PT_GNU_RELRO && lo <= a && a < hi)
            return PROT_READ;
    }
    return (load->p_flags & PF_R ? PROT_READ : 0) | (load->p_flags & PF_W ? PROT_WRITE : 0) |
           (load->p_flags & PF_X ? PROT_EXEC : 0);
}

enum stored { STORED, NOT_STORED, STORED_PAGE_LEFT_WRITABLE };

/* Writes value into *slot, opening a read-only page for the write and closing it again. */
static enum stored store(const struct dl_phdr_info *info, uintptr_t *slot, uintptr_t value,
                         const char **why) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)slot;
    void *base = (void *)(a & ~(page - 1));
    int prot = protection(info, a, page);

    if (prot < 0 || a % sizeof *slot) {
        *why = prot < 0 ? "is outside the object's segments" : "is not aligned";
        return NOT_STORED;
    }
    if (!(prot & PROT_WRITE) && mprotect(base, page, prot | PROT_WRITE) != 0) {
        *why = "could not be made writable (mprotect)";
        return NOT_STORED;
    }
    /* One aligned store: a thread calling through the slot meanwhile gets the old or the new one. */
    __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
    if (!(prot & PROT_WRITE) && mprotect(base, page, prot) != 0) {
        *why = "was written, but its page stays writable (mprotect)";
        return STORED_PAGE_LEFT_WRITABLE;
    }
    return STORED;
}

struct tally {
    int found, numeric;
    char why[256];
};

/* Only what the dynamic linker would have put in the slot is replaced: the address dlsym gives,
 * or, for a lazily bound call, this object's own PLT stub. Anything else is someone's choice. */
static int linker_value(const struct image *im, uintptr_t held, unsigned type) {
    return held == (uintptr_t)real_getnameinfo || (type == JUMP_SLOT && segment(im->info, held, PT_LOAD));
}

static void patch_slot(const struct image *im, uintptr_t *slot, unsigned type, void *ctx) {
    struct tally *t = ctx;
    uintptr_t held = __atomic_load_n(slot, __ATOMIC_SEQ_CST), ours = (uintptr_t)&numeric_getnameinfo;
    const char *why = NULL;

    t->found++;
    if (held == ours) {
        t->numeric++;
        return;
    }
    if (!linker_value(im, held, type)) {
        snprintf(t->why, sizeof t->why,
                 "slot %p holds %p, neither getnameinfo nor this object's PLT: left alone", (void *)slot,
                 (void *)held);
        return;
    }
    switch (store(im->info, slot, ours, &why)) {
    case STORED: t->numeric++; return;
    case STORED_PAGE_LEFT_WRITABLE: t->numeric++; break;
    case NOT_STORED: break;
    }
    snprintf(t->why, sizeof t->why, "slot %p %s", (void *)slot, why);
}

struct outcome {
    char path[PATH_MAX];
    int numeric;
    char why[256];
};

/* One patch() over the loaded objects; filled under the loader's lock, so no Python calls here. */
struct run {
    const char **prefixes;
    Py_ssize_t n_prefixes;
    struct outcome *out;
    size_t n, cap;
    int out_of_memory;
};

static int under(const char *path, const struct run *r) {
    for (Py_ssize_t i = 0; i < r->n_prefixes; i++)
        if (strncmp(path, r->prefixes[i], strlen(r->prefixes[i])) == 0)
            return 1;
    return 0;
}

static struct outcome *add(struct run *r) {
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 8;
        struct outcome *more = realloc(r->out, cap * sizeof *more);
        if (!more)
            return NULL;
        r->out = more;
        r->cap = cap;
    }
    memset(&r->out[r->n], 0, sizeof r->out[r->n]);
    return &r->out[r->n++];
}

static void patch_image(const struct dl_phdr_info *info, struct outcome *o) {
    struct image im;
    struct tally t = {0, 0, ""};
    const char *why = read_image(info, &im);

    if (why) {
        snprintf(o->why, sizeof o->why, "%s", why);
        return;
    }
    for_each_slot(&im, patch_slot, &t);
    o->numeric = t.numeric;
    if (t.numeric < t.found)
        snprintf(o->why, sizeof o->why, "%d of %d slots not patched: %s", t.found - t.numeric, t.found,
                 t.why);
    else if (t.why[0])
        snprintf(o->why, sizeof o->why, "%s", t.why);
}

static int patch_object(struct dl_phdr_info *info, size_t size, void *ctx) {
    struct run *r = ctx;
    char path[PATH_MAX];
    struct outcome *o;

    (void)size;
    if (!info->dlpi_name[0] || !realpath(info->dlpi_name, path) || !under(path, r))
        return 0;
    if (!(o = add(r))) {
        r->out_of_memory = 1;
        return 1;
    }
    memcpy(o->path, path, sizeof path);
    patch_image(info, o);
    return 0;
}

/* The prefixes as C strings, borrowed from the tuple (alive for the call); NULL with an exception set. */
static const char **c_prefixes(PyObject *tuple, Py_ssize_t *n) {
    const char **out;
    *n = PyTuple_GET_SIZE(tuple);
    out = PyMem_Calloc((size_t)*n + 1, sizeof *out);
    if (!out)
        return (const char **)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (!(out[i] = PyUnicode_AsUTF8(PyTuple_GET_ITEM(tuple, i)))) {
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *outcomes(const struct run *r) {
    PyObject *list = PyList_New(0);
    for (size_t i = 0; list && i < r->n; i++) {
        PyObject *item = Py_BuildValue("(sis)", r->out[i].path, r->out[i].numeric, r->out[i].why);
        if (!item || PyList_Append(list, item) != 0)
            Py_CLEAR(list);
        Py_XDECREF(item);
    }
    return list;
}

static PyObject *patch(PyObject *self, PyObject *args) {
    PyObject *tuple, *list = NULL;
    struct run r = {NULL, 0, NULL, 0, 0, 0};

    (void)self;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &tuple))
        return NULL;
    if (!real_getnameinfo)
        return PyErr_Format(PyExc_OSError, "dlsym(RTLD_DEFAULT, \"getnameinfo\") found nothing");
    if (!(r.prefixes = c_prefixes(tuple, &r.n_prefixes)))
        return NULL;
    /* The GIL stays held: it serialises patch() calls, whose page protections must not interleave. */
    dl_iterate_phdr(patch_object, &r);
    list = r.out_of_memory ? PyErr_NoMemory() : outcomes(&r);
    free(r.out);
    PyMem_Free(r.prefixes);
    return list;
}

enum { MAX_SLOTS = 16 };

struct inspection {
    const char *path;
    int loaded;
    const char *why;
    size_t n;
    uintptr_t slot[MAX_SLOTS], held[MAX_SLOTS];
    unsigned type[MAX_SLOTS];
};

static void note_slot(const struct image *im, uintptr_t *slot, unsigned type, void *ctx) {
    struct inspection *s = ctx;
    (void)im;
    if (s->n < MAX_SLOTS) {
        s->slot[s->n] = (uintptr_t)slot;
        s->held[s->n] = __atomic_load_n(slot, __ATOMIC_SEQ_CST);
        s->type[s->n++] = type;
    }
}

static int inspect_object(struct dl_phdr_info *info, size_t size, void *ctx) {
    struct inspection *s = ctx;
    char path[PATH_MAX];
    struct image im;

    (void)size;
    if (!info->dlpi_name[0] || !realpath(info->dlpi_name, path) || strcmp(path, s->path) != 0)
        return 0;
    s->loaded = 1;
    if (!(s->why = read_image(info, &im)))
        for_each_slot(&im, note_slot, s);
    return 1;
}

static PyObject *slots(PyObject *self, PyObject *args) {
    struct inspection s;
    PyObject *list;

    (void)self;
    memset(&s, 0, sizeof s);
    if (!PyArg_ParseTuple(args, "s", &s.path))
        return NULL;
    dl_iterate_phdr(inspect_object, &s);
    if (!s.loaded)
        return PyErr_Format(PyExc_LookupError, "%s is not loaded", s.path);
    if (s.why)
        return PyErr_Format(PyExc_OSError, "%s: %s", s.path, s.why);
    list = PyList_New(0);
    for (size_t i = 0; list && i < s.n; i++) {
        PyObject *item = Py_BuildValue("(KKs)", (unsigned long long)s.slot[i], (unsigned long long)s.held[i],
                                       s.type[i] == JUMP_SLOT ? "JUMP_SLOT" : "GLOB_DAT");
        if (!item || PyList_Append(list, item) != 0)
            Py_CLEAR(list);
        Py_XDECREF(item);
    }
    return list;
}

#else /* neither x86-64 nor AArch64 Linux: the relocation types are not known here */

static PyObject *unsupported(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyErr_Format(PyExc_NotImplementedError,
                        "getnameinfo's slots are found on x86-64 and AArch64 Linux only");
}
#define patch unsupported
#define slots unsupported

#endif

static PyMethodDef methods[] = {
    {"address", address, METH_NOARGS, "address() -> int: the numeric getnameinfo()."},
    {"patch", patch, METH_VARARGS,
     "patch(prefixes: tuple[str, ...]) -> list[tuple[str, int, str]]: for each loaded object whose\n"
     "real path starts with a prefix, (path, slots of getnameinfo now numeric, why not all or '')."},
    {"slots", slots, METH_VARARGS,
     "slots(path: str) -> list[tuple[int, int, str]]: the loaded object's getnameinfo slots:\n"
     "(address, what it holds, 'JUMP_SLOT' or 'GLOB_DAT')."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_numeric_names", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__numeric_names(void) {
    /* The address the dynamic linker gives an import of getnameinfo; what a slot is checked against. */
    real_getnameinfo = (getnameinfo_fn)dlsym(RTLD_DEFAULT, "getnameinfo");
    return PyModule_Create(&module);
}
