# a model that trains in seconds on a CPU
n_layer = 2
n_head = 2
n_embd = 64
block_size = 32
batch_size = 8
max_iters = 60
eval_interval = 20
eval_iters = 4
