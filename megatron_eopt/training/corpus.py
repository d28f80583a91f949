"""A real-text corpus present on every machine: the Python standard library's own source.

`prepare_stdlib_corpus(cache_dir)` writes a fixed subset of the running interpreter's stdlib
`*.py` files (test folders left out) to JSONL, one file a document, and converts it with
tools/preprocess_data.py (byte-level: no vocabulary to ship) into a Megatron indexed dataset.
Nothing is downloaded. Files are ordered by the SHA-256 of their relative path, a fixed shuffle,
and taken in that order until `max_bytes`; so `--split 95,5,0` holds out whole files, a mix of
the library, for validation. The same Python version gives the same bytes (the manifest records
each file and the JSONL's hash). The result is cached: a second call only checks the files exist.
"""

import contextlib
import gzip
import hashlib
import io
import json
import os
import pathlib
import re
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

EXCLUDED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
DEFAULT_MAX_BYTES = 4_000_000
TOKENIZER_FLAGS = ("--tokenizer-type", "ByteLevelTokenizer")
SPLIT = "95,5,0"  # train, validation, test: by document, i.e. by source file


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

    def build(into: pathlib.Path) -> None:
        files = stdlib_files(source, max_bytes)
        jsonl = into / "stdlib.jsonl"
        total = write_jsonl(files, source, jsonl)
        if verbose:
            print(f"> corpus: {len(files)} files of {source} ({total / 1e6:.2f} MB) -> {folder}", flush=True)
        _preprocess(jsonl, into / "stdlib", verbose)
        manifest = {"python": sys.version.split()[0], "source": str(source), "max_bytes": max_bytes, "bytes": total,
                    "split": SPLIT, "jsonl_sha256": hashlib.sha256(jsonl.read_bytes()).hexdigest(),
                    "files": [file.relative_to(source).as_posix() for file in files]}
        (into / "manifest.json").write_text(json.dumps(manifest, indent=1))

    manifest = _built_once(folder, "stdlib", build)
    return Corpus(_prefix(folder, "stdlib"), len(manifest["files"]), manifest["bytes"])


def _prefix(folder: pathlib.Path, name: str) -> str:
    return str((folder / name).resolve()) + "_text_document"


def _complete(folder: pathlib.Path, name: str) -> bool:
    prefix = _prefix(folder, name)
    return (folder / "manifest.json").exists() and all(os.path.exists(prefix + ext) for ext in (".bin", ".idx"))


def _built_once(folder: pathlib.Path, name: str, build) -> dict:
    """The manifest of the corpus cached in `folder`, built there by `build(into)` if missing. The
    build writes a folder of its own and renames it into place, so runs that start together on a
    fresh machine (two jobs, two test workers) never read a half-written corpus: the first rename
    wins and the others use its folder."""
    if not _complete(folder, name):
        folder.parent.mkdir(parents=True, exist_ok=True)
        building = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            build(building)
            if folder.exists() and not _complete(folder, name):  # left by a build that was killed
                shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rename(building, folder)  # fails where another build got there first
        finally:
            shutil.rmtree(building, ignore_errors=True)
        if not _complete(folder, name):
            raise RuntimeError(f"the corpus in {folder} is incomplete after its build; remove the folder and retry.")
    return json.loads((folder / "manifest.json").read_text())


def _preprocess(jsonl: pathlib.Path, output_prefix: pathlib.Path, verbose: bool) -> None:
    """tools/preprocess_data.py's `main`, in this process (a new one would import megatron-core
    again, about 7 s): byte-level, one document per JSONL line, EOD appended."""
    from megatron_eopt.training.data import preprocess

    argv = ["--input", str(jsonl), "--output-prefix", str(output_prefix), *TOKENIZER_FLAGS, "--append-eod",
            "--workers", "1", "--log-interval", "1000000"]
    with contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO()):
        preprocess.main(argv)


# ------------------------------------------------------------------------------------------------
# Corpora of other kinds (benchmarks/convergence_range.py): English prose and roff markup, from
# documentation that Debian's packages install. Each is built as the stdlib's is: documents in a
# fixed SHA-256 order up to a byte budget, one JSONL, the byte-level indexed dataset, a manifest
# with every document's source and the JSONL's hash. The folder's name carries a digest of the
# chosen sources' bytes, so other sources (another image) give another corpus, never a silent mix.
# ------------------------------------------------------------------------------------------------

INFO_ROOT = "/usr/share/info"
MAN_ROOT = "/usr/share/man"
# Manuals of C libraries (their APIs are C declarations, close to the system headers that stay out
# as the outside check): left out of the prose.
INFO_C_LIBRARY_MANUALS = frozenset({"autosprintf", "gpgrt", "libffi", "libtasn1", "nettle"})
# Nodes that are not prose written for the manual: licences, indexes, the tag table.
INFO_SKIPPED_NODE = re.compile(r"licen[cs]e|copying|index|^tag table|^indirect", re.IGNORECASE)
# Sections 1 (commands), 5 (file formats), 7 (overviews), 8 (administration); not 2 and 3 (C
# system and library calls: the C headers' content). gcloud's 16,000 generated pages are left out.
MAN_SECTIONS = ("man1", "man5", "man7", "man8")
MAN_GENERATED_PREFIXES = ("gcloud",)


@dataclass(frozen=True)
class Document:
    name: str  # where it came from, relative to its root (an info node: FILE#NODE)
    text: str


def info_nodes(root: str = INFO_ROOT) -> list[Document]:
    """The nodes of the GNU Info manuals under `root` (gzip'ed), one document each: English prose
    (sed, grep, coreutils, find, diffutils, gettext, wget, gnupg, ...), without the C library
    manuals, licence and index nodes."""
    documents = []
    for path in sorted(pathlib.Path(root).glob("*.info*.gz")):
        manual = path.name.split(".info")[0]
        if manual in INFO_C_LIBRARY_MANUALS:
            continue
        text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        for chunk in text.split("\x1f")[1:]:  # before the first separator: the file's preamble
            header, _, body = chunk.lstrip("\n").partition("\n")
            node = re.search(r"Node: ([^,\t]+)", header)
            if node is None or INFO_SKIPPED_NODE.search(node.group(1)) or not body.strip():
                continue
            documents.append(Document(f"{path.name}#{node.group(1).strip()}", body.strip("\n") + "\n"))
    return documents


def man_pages(root: str = MAN_ROOT) -> list[Document]:
    """English manual pages in roff (gzip'ed) of MAN_SECTIONS, one page a document; links and
    `.so` redirections skipped."""
    documents = []
    for section in MAN_SECTIONS:
        for path in sorted((pathlib.Path(root) / section).glob("*.gz")):
            if path.is_symlink() or path.name.startswith(MAN_GENERATED_PREFIXES):
                continue
            text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
            if text.lstrip().startswith(".so ") or not text.strip():
                continue
            documents.append(Document(f"{section}/{path.name}", text))
    return documents


CORPUS_SOURCES = {"gnu-info": (INFO_ROOT, info_nodes), "manpages": (MAN_ROOT, man_pages)}


def choose_documents(documents: list[Document], max_bytes: int) -> list[Document]:
    """`documents` in SHA-256 order of their names, as many as fit in `max_bytes`."""
    chosen, total = [], 0
    for document in sorted(documents, key=lambda d: hashlib.sha256(d.name.encode()).hexdigest()):
        size = len(document.text.encode("utf-8"))
        if size and total + size <= max_bytes:
            chosen.append(document)
            total += size
    return chosen


def prepare_corpus(name: str, cache_dir: str = "data", max_bytes: int = DEFAULT_MAX_BYTES,
                   root: str | None = None, verbose: bool = True) -> Corpus:
    """Build (or reuse) corpus `name` ('stdlib', 'gnu-info' or 'manpages') under `cache_dir`."""
    if name == "stdlib":
        return prepare_stdlib_corpus(cache_dir, max_bytes, root, verbose)
    if name not in CORPUS_SOURCES:
        raise ValueError(f"corpus must be one of 'stdlib', {', '.join(map(repr, CORPUS_SOURCES))}; got {name!r}.")
    default_root, read = CORPUS_SOURCES[name]
    source = root or default_root
    documents = choose_documents(read(source), max_bytes)
    digest = hashlib.sha256()
    for document in documents:
        digest.update(document.name.encode() + b"\0" + document.text.encode("utf-8") + b"\0")
    folder = pathlib.Path(cache_dir) / f"{name}-{digest.hexdigest()[:12]}-{max_bytes}"

    def build(into: pathlib.Path) -> None:
        jsonl = into / f"{name}.jsonl"
        with open(jsonl, "w", encoding="utf-8") as handle:
            for document in documents:
                handle.write(json.dumps({"text": document.text, "path": document.name}) + "\n")
        total = sum(len(d.text.encode("utf-8")) for d in documents)
        if verbose:
            print(f"> corpus {name}: {len(documents)} documents of {source} ({total / 1e6:.2f} MB) -> {folder}",
                  flush=True)
        _preprocess(jsonl, into / name, verbose)
        manifest = {"corpus": name, "source": source, "max_bytes": max_bytes, "bytes": total,
                    "sources_sha256": digest.hexdigest(), "jsonl_sha256": hashlib.sha256(jsonl.read_bytes()).hexdigest(),
                    "documents": [d.name for d in documents],
                    "document_bytes": [len(d.text.encode("utf-8")) for d in documents]}
        (into / "manifest.json").write_text(json.dumps(manifest, indent=1))

    manifest = _built_once(folder, name, build)
    return Corpus(_prefix(folder, name), len(manifest["documents"]), manifest["bytes"])
