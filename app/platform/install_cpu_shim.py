"""Install (CPU-only torch) or remove (CUDA torch) the torchvision/torchaudio import hook in this interpreter's
site-packages.

Run by `make setup`: `python -m app.platform.install_cpu_shim`. Idempotent; prints what it did.
"""

import shutil
import sysconfig
from pathlib import Path

MODULE_NAME = "ray_flowgrpo_cpu_torch_shim"


def install(site_packages: Path | None = None) -> str:
    import torch  # torchvision is not imported here: that is what fails without the shim

    site = Path(site_packages or sysconfig.get_paths()["purelib"])
    module_file, pth_file = site / f"{MODULE_NAME}.py", site / f"{MODULE_NAME}.pth"
    if torch.version.cuda is not None:
        for f in (module_file, pth_file):
            f.unlink(missing_ok=True)
        return f"torch {torch.__version__} has CUDA: no shim installed (removed any old one from {site})"
    shutil.copyfile(Path(__file__).with_name("cpu_torch_shim.py"), module_file)
    pth_file.write_text(f"import {MODULE_NAME}\n")
    return f"torch {torch.__version__} is CPU-only: installed {pth_file.name} and {module_file.name} in {site}"


if __name__ == "__main__":
    print(install())
