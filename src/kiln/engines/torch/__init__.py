"""The PyTorch backend: TorchScript ``model.pt`` and torch.export / AOTInductor ``model.pt2``."""

try:
    from kiln.engines.torch.engine import TorchEngine
except ModuleNotFoundError as missing:  # torch is an optional extra
    if missing.name != "torch":
        raise
    # A factory with TorchEngine's call signature that raises UNAVAILABLE naming the install command.
    from kiln.engines.torch.missing import TorchEngine  # type: ignore[assignment]

__all__ = ["TorchEngine"]
