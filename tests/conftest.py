import sys
from pathlib import Path

import torch

# tests import their shared helpers (golden_utils, ...) as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
