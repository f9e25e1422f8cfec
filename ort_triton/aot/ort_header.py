"""Find the ONNX Runtime C API header the native library compiles against.

onnxruntime wheels ship no headers. Order: an explicit directory, $ORT_INCLUDE_DIR, a copy cached by an
earlier build, then Debian's libonnxruntime-dev (trixie, ORT 1.21, ORT_API_VERSION 21; a library built
against API 21 loads in newer ORT) fetched with `apt-get download` into the cache, installing nothing.
The header is never committed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile

HEADER = "onnxruntime_c_api.h"
_DEB = "libonnxruntime-dev"
_SOURCE = "deb http://deb.debian.org/debian trixie main\n"


class HeaderNotFound(RuntimeError):
    pass


def find_ort_include(explicit: str | os.PathLike | None, cache_dir: pathlib.Path) -> pathlib.Path:
    for cand in (explicit, os.environ.get("ORT_INCLUDE_DIR")):
        if cand:
            path = pathlib.Path(cand)
            if not (path / HEADER).exists():
                raise HeaderNotFound(f"{path} has no {HEADER} (given as the ORT include directory)")
            return path
    cached = cache_dir / "ort-include"
    if (cached / HEADER).exists():
        return cached
    return _fetch_from_debian(cached)


def _fetch_from_debian(dest: pathlib.Path) -> pathlib.Path:
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        raise HeaderNotFound(f"no {HEADER}: set ORT_INCLUDE_DIR to a directory holding ONNX Runtime's C headers "
                             "(for example from a libonnxruntime-dev package or an ORT release archive)")
    with tempfile.TemporaryDirectory() as tmp:
        t = pathlib.Path(tmp)
        (t / "lists" / "partial").mkdir(parents=True)
        (t / "archives" / "partial").mkdir(parents=True)
        (t / "sources.list").write_text(_SOURCE)
        opts = [f"-oDir::Etc::sourcelist={t / 'sources.list'}", "-oDir::Etc::sourceparts=-",
                f"-oDir::State::Lists={t / 'lists'}", f"-oDir::Cache={t}", "-oAPT::Sandbox::User=root", "-q"]
        try:
            subprocess.run(["apt-get", *opts, "update"], check=True, capture_output=True, text=True)
            subprocess.run(["apt-get", *opts, "download", _DEB], check=True, capture_output=True, text=True, cwd=t)
            deb = next(t.glob(f"{_DEB}_*.deb"))
            subprocess.run(["dpkg", "-x", str(deb), str(t / "x")], check=True, capture_output=True, text=True)
        except (subprocess.CalledProcessError, StopIteration) as e:
            detail = getattr(e, "stderr", "") or ""
            raise HeaderNotFound(f"could not fetch {_DEB} from Debian trixie to get {HEADER}: {detail.strip()[-400:]}\n"
                                 "Set ORT_INCLUDE_DIR to a directory holding ONNX Runtime's C headers.") from e
        src = t / "x" / "usr" / "include" / "onnxruntime"
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(dir=dest.parent))
        for h in src.glob("*.h"):
            shutil.copy2(h, staging / h.name)
        if dest.exists():
            shutil.rmtree(staging)
        else:
            staging.rename(dest)
    return dest
