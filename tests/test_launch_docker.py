"""launch/docker/Dockerfile, checked without docker (no daemon here; the image was never built by these tests).

What can be checked: every COPY source exists and survives the .dockerignore, torch is pinned to the
README's version from the CPU wheel index, elastictrain is installed with the [s3] extra, and the
command the image runs is one of the project's console scripts.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib

from tests.conftest import REPO_ROOT

DOCKERFILE = REPO_ROOT / "launch" / "docker" / "Dockerfile"
DOCKERIGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                             if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_every_copied_path_exists_and_is_in_the_build_context():
    kept = {line.strip("!").rstrip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")}
    copies = [shlex.split(arguments)[:-1] for name, arguments in instructions() if name == "COPY"]
    assert copies, "the Dockerfile copies the project in"
    for sources in copies:
        for source in sources:
            assert (REPO_ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            assert source.rstrip("/") in kept, f"COPY {source}: excluded by {DOCKERIGNORE.name}"


def test_torch_is_the_readmes_cpu_build_and_elastictrain_has_the_s3_extra():
    runs = [arguments for name, arguments in instructions() if name == "RUN"]
    readme_torch = re.search(r"pip install torch==([\d.]+)", (REPO_ROOT / "README.md").read_text()).group(1)
    torch_lines = [run for run in runs if "torch==" in run]
    assert len(torch_lines) == 1
    assert f"torch=={readme_torch}" in torch_lines[0].split()
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_lines[0]
    assert runs.index(torch_lines[0]) < next(i for i, run in enumerate(runs) if "'.[s3]'" in run), \
        "torch before elastictrain, so pip keeps the CPU build"
    assert "s3" in pyproject()["project"]["optional-dependencies"]


def test_the_image_runs_a_console_script_of_the_project():
    commands = [json.loads(arguments) for name, arguments in instructions() if name == "CMD"]
    assert len(commands) == 1
    assert commands[0][0] in pyproject()["project"]["scripts"]
    assert commands[0][-3:] == ["-m", "elastictrain", "train"]
