/* getnameinfo() that never asks a name server: the numeric host and port.
 *
 * torch's c10d formats the address of every socket its TCPStore accepts or connects with
 * getnameinfo() and no NI_NUMERICHOST, a reverse DNS lookup, on the store server's event loop.
 * A lost answer costs the resolver's timeout (5 s by default) to every client of the store.
 * resilient.native.names points libtorch's import of getnameinfo here. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <netdb.h>
#include <sys/socket.h>

static int numeric_getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen,
                               char *serv, socklen_t servlen, int flags) {
    return getnameinfo(sa, salen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST | NI_NUMERICSERV);
}

static PyObject *address(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromVoidPtr((void *)&numeric_getnameinfo);
}

static PyMethodDef methods[] = {
    {"address", address, METH_NOARGS, "The address of the numeric getnameinfo()."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_numeric_names", NULL, -1, methods};

PyMODINIT_FUNC PyInit__numeric_names(void) { return PyModule_Create(&module); }
