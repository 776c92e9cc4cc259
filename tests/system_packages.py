"""Debian packages a system test needs (SLURM's daemons, pdflatex), installed with apt-get when
missing: one place for the install, the stale-list retry and the skip with apt's own words."""

import os
import shutil
import subprocess

import pytest


def apt_install_or_skip(packages: list[str], missing, what: str, timeout: int = 600) -> None:
    """Install ``packages`` when ``missing()`` (the names still absent) is not empty; skip, naming
    them, where there is no apt-get or the install leaves something missing. The caller checks
    for root and Linux first, with its own reason."""
    if not missing():
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"{what} is not installed ({', '.join(missing())} missing) and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # unsafe-io: dpkg skips an fsync per unpacked file (texlive has thousands); a crash midway
    # leaves a scratch machine to reinstall, not a system to repair
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "Dpkg::Options::=--force-unsafe-io",
               *packages]
    out = subprocess.run(install, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:  # a stale package list: update once, then try again
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=600)
        out = subprocess.run(install, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0 or missing():
        pytest.skip(f"apt-get could not install {' '.join(packages)}: {(out.stdout + out.stderr)[-1500:]}")
