"""lighthouse: PyTorch kernels -> linalg -> transform-dialect schedules -> CPU JIT or Intel XeGPU."""

__version__ = "0.1.0"

import warnings

# torch.export's pytree helpers warn about their own deprecated API on every import.
warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
