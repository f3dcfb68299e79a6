"""Algorithm tests run on one torch thread: the machine's two cores are shared."""

import torch

torch.set_num_threads(1)
