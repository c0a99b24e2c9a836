"""lighthouse: PyTorch kernels -> linalg -> transform-dialect schedules -> CPU JIT or Intel XeGPU."""

__version__ = "0.1.0"

import warnings

# torch.export's pytree helpers warn about their own deprecated API on every import.
warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


def __getattr__(name):
    # lighthouse.compile_module without importing torch on `import lighthouse`
    if name == "compile_module":
        from .api import compile_module

        return compile_module
    raise AttributeError(f"module 'lighthouse' has no attribute {name!r}")
