# Overrides the training script's globals, the way popular single-file GPT trainers do: each
# argument is a config file to exec, or --key=value for a global that already exists.
#     python train.py config/tiny.py --max_iters=80
# Exec'd by train.py from its own directory (a relative path: run it from here).
import sys
from ast import literal_eval

for arg in sys.argv[1:]:
    if not arg.startswith("--"):
        print(f"Overriding config with {arg}:")
        with open(arg) as f:
            exec(f.read())
        continue
    key, _, val = arg[2:].partition("=")
    if key not in globals():
        raise ValueError(f"Unknown config key: {key}")
    try:
        value = literal_eval(val)
    except (SyntaxError, ValueError):
        value = val
    if type(value) is not type(globals()[key]):
        raise TypeError(f"--{key}={val}: expected a {type(globals()[key]).__name__}")
    print(f"Overriding: {key} = {value}")
    globals()[key] = value
