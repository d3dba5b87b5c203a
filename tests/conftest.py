import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
