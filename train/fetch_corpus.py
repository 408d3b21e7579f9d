#!/usr/bin/env python
"""Download the default model's package corpus and write its licence list.

Reads ``train/corpus_requirements.txt`` (exact versions with wheel hashes),
downloads the wheels with ``pip download --no-deps --require-hashes`` into
``<corpus>/wheels/``, reads each wheel's licence from its metadata and refuses
any that is not permissive (``licence_of``), and extracts the ``.py`` files to
``<corpus>/pypi/<name>/``.  Then it runs the corpus pipeline (train/corpus.py:
cleaning, deduplication, cap, split) once and writes two committed listings:

    train/corpus_sources.tsv   source, version, licence, files and bytes kept
    train/heldout.tsv          the held-out files with their SHA-256

The downloaded data stays under ``<corpus>`` (default ``train/corpus``,
git-ignored).  Only this step needs the network; training and evaluation
read the extracted files.

    python train/fetch_corpus.py            # download, extract, list
    python train/fetch_corpus.py --offline  # re-extract from the wheels already there
"""

from __future__ import annotations

import argparse
import email
import json
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import corpus as corpus_mod

HERE = Path(__file__).resolve().parent

# The licences the corpus may hold, as SPDX identifiers.  "BSD" stands for a
# package that only says "BSD" (classifier "BSD License"): every BSD variant
# is permissive.
PERMISSIVE = {"MIT", "BSD", "0BSD", "BSD-2-Clause", "BSD-3-Clause", "Apache-2.0", "PSF-2.0", "Python-2.0"}

CLASSIFIERS = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: BSD License": "BSD",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
}

# Free-text License fields seen in the pinned packages, normalised (case and
# punctuation folded) -> SPDX.  Anything else is refused until a person has
# read it and added it here.
LICENCE_TEXT = {
    "mit": "MIT",
    "mit license": "MIT",
    "bsd": "BSD",
    "bsd license": "BSD",
    "bsd 2 clause": "BSD-2-Clause",
    "bsd 3 clause": "BSD-3-Clause",
    "bsd 3 clause license": "BSD-3-Clause",
    "apache 2 0": "Apache-2.0",
    "apache license 2 0": "Apache-2.0",
    "apache software license": "Apache-2.0",
    "psf 2 0": "PSF-2.0",
}

# pip's target tags: the same wheel on every machine, whatever its platform.
# Requires-Python is ignored: the wheels are read, never installed.
TAGS = ["--only-binary", ":all:", "--ignore-requires-python", "--python-version", "3.11", "--implementation", "cp",
        "--abi", "cp311", "--abi", "abi3", "--abi", "none",
        "--platform", "manylinux_2_28_x86_64", "--platform", "any"]


class LicenceError(ValueError):
    pass


def _spdx_allowed(expr: str) -> bool:
    """Evaluate an SPDX expression: OR needs one permissive side, AND both.
    ``WITH`` exceptions and unknown ids count as not permissive."""
    tokens = re.findall(r"\(|\)|[A-Za-z0-9.+-]+", expr)
    pos = 0

    def atom():
        nonlocal pos
        tok = tokens[pos] if pos < len(tokens) else None
        pos += 1
        if tok == "(":
            value = disjunction()
            if pos >= len(tokens) or tokens[pos] != ")":
                raise LicenceError(f"unbalanced parentheses in licence expression {expr!r}")
            pos += 1
            return value
        if tok is None or tok.upper() in ("AND", "OR", "WITH", ")"):
            raise LicenceError(f"cannot parse licence expression {expr!r}")
        value = tok in PERMISSIVE
        if pos < len(tokens) and tokens[pos].upper() == "WITH":
            pos += 2  # an exception clause: not a plain permissive licence
            value = False
        return value

    def conjunction():
        nonlocal pos
        value = atom()
        while pos < len(tokens) and tokens[pos].upper() == "AND":
            pos += 1
            value = atom() and value
        return value

    def disjunction():
        nonlocal pos
        value = conjunction()
        while pos < len(tokens) and tokens[pos].upper() == "OR":
            pos += 1
            value = conjunction() or value
        return value

    value = disjunction()
    if pos != len(tokens):
        raise LicenceError(f"cannot parse licence expression {expr!r}")
    return value


def licence_of(metadata: str, name: str = "package"):
    """-> (licence, where it was read) from a wheel's METADATA text; raises
    LicenceError when it is not permissive or cannot be read.

    License-Expression (PEP 639) decides when present.  Otherwise every
    licence claim (License classifiers and the License field) must be a
    known permissive one: a package that also lists the GPL is refused.
    """
    msg = email.message_from_string(metadata)
    expr = (msg.get("License-Expression") or "").strip()
    if expr:
        if not _spdx_allowed(expr):
            raise LicenceError(f"{name}: licence {expr!r} is not permissive ({', '.join(sorted(PERMISSIVE))})")
        return expr, "License-Expression"
    claims = {}  # SPDX id -> where it was read (a set)
    for c in msg.get_all("Classifier") or []:
        if c.startswith("License ::"):
            if c not in CLASSIFIERS:
                raise LicenceError(f"{name}: classifier {c!r} is not a permissive licence")
            claims.setdefault(CLASSIFIERS[c], set()).add("classifier")
    field = (msg.get("License") or "").strip()
    if field:
        first = re.sub(r"[^a-z0-9]+", " ", field.splitlines()[0].lower()).strip()
        if first not in LICENCE_TEXT:
            raise LicenceError(f"{name}: License field {field.splitlines()[0]!r} is not a licence "
                               "this script knows; read it and add it to LICENCE_TEXT if permissive")
        claims.setdefault(LICENCE_TEXT[first], set()).add("License field")
    if not claims:
        raise LicenceError(f"{name}: no licence in its metadata")
    # A classifier's bare "BSD" adds nothing to a field's "BSD-3-Clause".
    if len(claims) > 1 and "BSD" in claims and any(c.startswith("BSD-") for c in claims):
        del claims["BSD"]
    names = sorted(claims)
    return " / ".join(names), " and ".join(sorted(set().union(*claims.values())))


def read_requirements(path):
    """[(name, version)] in file order."""
    pins = []
    for ln in Path(path).read_text(encoding="utf-8").splitlines():
        ln = ln.split("#", 1)[0].strip()
        if ln:
            m = re.match(r"([A-Za-z0-9._-]+)==([^\s]+)\s+--hash=sha256:[0-9a-f]{64}$", ln)
            if not m:
                raise SystemExit(f"{path}: expected `name==version --hash=sha256:...`, got {ln!r}")
            pins.append((m.group(1).lower(), m.group(2)))
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def find_wheel(wheels: Path, name: str, version: str) -> Path:
    for w in wheels.glob("*.whl"):
        dist, ver = w.name.split("-")[:2]
        if canonical(dist) == name and ver == version:
            return w
    raise SystemExit(f"no wheel for {name}=={version} in {wheels}")


def extract(wheel: Path, dest: Path) -> int:
    """Write the wheel's .py files (outside .dist-info) under dest; -> count."""
    if dest.exists():
        shutil.rmtree(dest)
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if not info.filename.endswith(".py") or parts[0].endswith(".dist-info"):
                continue
            if info.filename.startswith("/") or ".." in parts:
                raise SystemExit(f"{wheel.name}: unsafe path {info.filename!r}")
            out = dest / info.filename
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(info))
            n += 1
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", default=str(HERE / "corpus"), help="where wheels and extracted files go")
    p.add_argument("--requirements", default=str(HERE / "corpus_requirements.txt"))
    p.add_argument("--offline", action="store_true", help="use the wheels already downloaded")
    p.add_argument("--sources-out", default=str(HERE / "corpus_sources.tsv"))
    p.add_argument("--heldout-out", default=str(HERE / "heldout.tsv"))
    args = p.parse_args(argv)

    root = Path(args.corpus)
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pins = read_requirements(args.requirements)
    if not args.offline:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                        "--disable-pip-version-check", "-q", *TAGS, "-r", args.requirements,
                        "-d", str(wheels)], check=True)

    packages = []
    for name, version in pins:
        wheel = find_wheel(wheels, name, version)
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            licence, where = licence_of(z.read(meta).decode("utf-8"), f"{name}=={version}")
        n = extract(wheel, root / "pypi" / name)
        packages.append(dict(name=name, version=version, licence=licence, licence_from=where,
                             wheel=wheel.name, py_files=n))
        print(f"{name}=={version}: {licence} ({where}), {n} .py files")
    (root / "packages.json").write_text(json.dumps(packages, indent=1) + "\n", encoding="utf-8")

    corpus = corpus_mod.build(root)
    write_sources(corpus, args.sources_out)
    corpus_mod.write_heldout_listing(corpus_mod.heldout_listing(corpus), args.heldout_out)
    kept = corpus.source_stats()
    print(f"kept {len(corpus.docs)} files, {sum(s['bytes'] for s in kept.values()):,} bytes "
          f"({len(corpus.heldout)} held out); dropped: {dict(corpus.dropped)}")
    print(f"wrote {args.sources_out} and {args.heldout_out}")


def write_sources(corpus, path) -> None:
    """The licence list: one row per source with what the pipeline kept of it."""
    stats = corpus.source_stats()
    py = platform.python_version()
    rows = [("stdlib", py, "PSF-2.0", "Python licence", "", corpus.read["stdlib"]),
            ("stdlib-tests", py, "PSF-2.0", "Python licence", "", corpus.read["stdlib-tests"])]
    rows += [(p["name"], p["version"], p["licence"], p["licence_from"], p["wheel"], p["py_files"])
             for p in corpus.packages]
    head = ["source", "version", "licence", "licence_from", "wheel", "py_files",
            "files", "bytes", "heldout_files", "heldout_bytes"]
    lines = ["\t".join(head)]
    for r in rows:
        s = stats.get(r[0], dict(files=0, bytes=0, heldout_files=0, heldout_bytes=0))
        lines.append("\t".join(map(str, (*r, s["files"], s["bytes"], s["heldout_files"], s["heldout_bytes"]))))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_sources(path) -> list:
    """corpus_sources.tsv -> [dict] (numbers as int)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    head = lines[0].split("\t")
    out = []
    for ln in lines[1:]:
        row = dict(zip(head, ln.split("\t")))
        for k in ("py_files", "files", "bytes", "heldout_files", "heldout_bytes"):
            row[k] = int(row[k])
        out.append(row)
    return out


if __name__ == "__main__":
    main()
