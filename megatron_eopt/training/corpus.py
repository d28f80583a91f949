"""A real-text corpus present on every machine: the Python standard library's own source.

`prepare_stdlib_corpus(cache_dir)` writes a fixed subset of the running interpreter's stdlib
`*.py` files (test folders left out) to JSONL, one file a document, and converts it with
tools/preprocess_data.py (byte-level: no vocabulary to ship) into a Megatron indexed dataset.
Nothing is downloaded. Files are ordered by the SHA-256 of their relative path, a fixed shuffle,
and taken in that order until `max_bytes`; so `--split 95,5,0` holds out whole files, a mix of
the library, for validation. The same Python version gives the same bytes (the manifest records
each file and the JSONL's hash). The result is cached: a second call only checks the files exist.
"""

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
from dataclasses import dataclass

EXCLUDED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
DEFAULT_MAX_BYTES = 4_000_000
TOKENIZER_FLAGS = ("--tokenizer-type", "ByteLevelTokenizer")
SPLIT = "95,5,0"  # train, validation, test: by document, i.e. by source file
PREPROCESS = pathlib.Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"


@dataclass(frozen=True)
class Corpus:
    prefix: str  # --data-path
    documents: int
    bytes: int

    def trainer_flags(self) -> list[str]:
        """The trainer's data flags for this corpus (train and validation splits)."""
        return ["--data-path", self.prefix, "--split", SPLIT, *TOKENIZER_FLAGS]


def stdlib_files(root: pathlib.Path, max_bytes: int) -> list[pathlib.Path]:
    """`root`'s *.py files outside EXCLUDED_FOLDERS, in SHA-256 order of their relative path,
    as many as fit in `max_bytes` (files that would overflow it are skipped)."""
    candidates = [path for path in root.rglob("*.py")
                  if not EXCLUDED_FOLDERS.intersection(path.relative_to(root).parts[:-1])]
    candidates.sort(key=lambda path: hashlib.sha256(path.relative_to(root).as_posix().encode()).hexdigest())
    chosen, total = [], 0
    for path in candidates:
        size = path.stat().st_size
        if size and total + size <= max_bytes:
            chosen.append(path)
            total += size
    return chosen


def write_jsonl(files: list[pathlib.Path], root: pathlib.Path, path: pathlib.Path) -> int:
    """One JSON line per file, {"text": source, "path": relative path}; returns bytes of text."""
    total = 0
    with open(path, "w", encoding="utf-8") as handle:
        for file in files:
            text = file.read_text(encoding="utf-8", errors="replace")
            total += len(text.encode("utf-8"))
            handle.write(json.dumps({"text": text, "path": file.relative_to(root).as_posix()}) + "\n")
    return total


def cache_folder(cache_dir: str, max_bytes: int) -> pathlib.Path:
    version = ".".join(map(str, sys.version_info[:3]))
    return pathlib.Path(cache_dir) / f"stdlib-py{version}-{max_bytes}"


def prepare_stdlib_corpus(cache_dir: str = "data", max_bytes: int = DEFAULT_MAX_BYTES,
                          root: str | None = None, verbose: bool = True) -> Corpus:
    """Build (or reuse) the corpus under `cache_dir`; returns its --data-path prefix."""
    source = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    folder = cache_folder(cache_dir, max_bytes)
    manifest_path = folder / "manifest.json"
    prefix = str((folder / "stdlib").resolve()) + "_text_document"
    if manifest_path.exists() and all(os.path.exists(prefix + ext) for ext in (".bin", ".idx")):
        manifest = json.loads(manifest_path.read_text())
        return Corpus(prefix, len(manifest["files"]), manifest["bytes"])
    folder.mkdir(parents=True, exist_ok=True)
    files = stdlib_files(source, max_bytes)
    jsonl = folder / "stdlib.jsonl"
    total = write_jsonl(files, source, jsonl)
    if verbose:
        print(f"> corpus: {len(files)} files of {source} ({total / 1e6:.2f} MB) -> {folder}", flush=True)
    command = [sys.executable, str(PREPROCESS), "--input", str(jsonl), "--output-prefix", str(folder / "stdlib"),
               *TOKENIZER_FLAGS, "--append-eod", "--workers", "1", "--log-interval", "1000000"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL if not verbose else None)
    manifest = {"python": sys.version.split()[0], "source": str(source), "max_bytes": max_bytes, "bytes": total,
                "split": SPLIT, "jsonl_sha256": hashlib.sha256(jsonl.read_bytes()).hexdigest(),
                "files": [file.relative_to(source).as_posix() for file in files]}
    manifest_path.write_text(json.dumps(manifest, indent=1))  # written last: marks the cache complete
    return Corpus(prefix, len(files), total)
