"""The README's usage example runs as written (with a free port), in a fresh interpreter."""

import pathlib
import re
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_usage_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    example = re.search(r"## Usage\n\n```python\n(.*?)```", text, re.S).group(1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = example.replace("29500", str(port)) + (
        "\nassert update_successful and grad_norm > 0 and num_zeros is None\n"
        "assert type(optimizer).__name__ == 'ChainedOptimizer'\nprint('README-OK')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "README-OK" in result.stdout
