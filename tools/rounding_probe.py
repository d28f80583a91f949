"""Print whether this process's kernel settings round differently from the default build's.

`make test-numerics` runs it under each setting it sweeps: a setting that leaves the bits of a
product and a softmax-sum unchanged on this machine tests nothing here, and the probe says so.
Usage: python tools/rounding_probe.py  (under the settings, e.g. ATEN_CPU_CAPABILITY=avx2)
"""

import hashlib
import json
import os
import subprocess
import sys

import torch

SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def fingerprints() -> dict[str, str]:
    """Hashes of the bits of an fp32 product (257x511 by 511x129) and of a softmax's row sums."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(257, 511, generator=generator), torch.randn(511, 129, generator=generator)
    x = torch.randn(64, 1000, generator=generator)
    results = {"a @ b": a @ b, "softmax(x).sum(-1)": torch.softmax(x, -1).sum(-1)}
    return {name: hashlib.sha1(t.numpy().tobytes()).hexdigest()[:12] for name, t in results.items()}


def main() -> int:
    if "--fingerprints" in sys.argv:
        print(json.dumps(fingerprints()))
        return 0
    default_env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    default = json.loads(subprocess.run([sys.executable, __file__, "--fingerprints"], env=default_env, check=True,
                                  capture_output=True, text=True).stdout)
    here = fingerprints()
    setting = " ".join(f"{k}={os.environ[k]}" for k in SETTINGS if k in os.environ) or "(default build)"
    changed = [name for name in here if here[name] != default[name]]
    print(f"{setting}: CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          + (f"changes the bits of {', '.join(changed)}" if changed else
             "rounds as the default build does on this machine: this setting tests nothing here"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
