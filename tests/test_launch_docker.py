"""launch/docker/Dockerfile, checked without docker (no daemon here; the image was never built by these tests).

What can be checked: every COPY source exists and survives the .dockerignore; the base image is the
Python release the tests run on; torch is the README's version from the wheel index of the build's
TORCH_VARIANT (cpu by default); elastictrain is installed with the image's extras under
constraints.txt, which pins every distribution they install at the version the tests ran with; the
image runs as a user other than root; its command is one of the project's console scripts.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import tomllib

from tests.conftest import REPO_ROOT
from tests.helpers.constraints import IMAGE_EXTRAS, installed_closure, read_pins

DOCKERFILE = REPO_ROOT / "launch" / "docker" / "Dockerfile"
DOCKERIGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")
CONSTRAINTS = DOCKERFILE.with_name("constraints.txt")


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


def build_args() -> dict[str, str]:
    """Each ARG's default value."""
    return dict(arguments.split("=", 1) for name, arguments in instructions() if name == "ARG" and "=" in arguments)


def test_torch_is_the_readmes_build_from_the_variants_index_and_cpu_by_default():
    runs = [arguments for name, arguments in instructions() if name == "RUN"]
    readme_torch = re.search(r"pip install torch==([\d.]+)", (REPO_ROOT / "README.md").read_text()).group(1)
    torch_lines = [run for run in runs if "torch==" in run]
    assert len(torch_lines) == 1
    assert f"torch=={readme_torch}" in torch_lines[0].split()
    assert "--index-url https://download.pytorch.org/whl/${TORCH_VARIANT}" in torch_lines[0]
    assert build_args()["TORCH_VARIANT"] == "cpu"
    assert runs.index(torch_lines[0]) < next(i for i, run in enumerate(runs) if "'.[" in run), \
        "torch before elastictrain, so pip keeps the variant's build"


def test_elastictrain_has_the_extras_an_operator_configures_and_every_install_is_pinned():
    (install,) = [arguments for name, arguments in instructions() if name == "RUN" and "'.[" in arguments]
    extras = re.search(r"'\.\[([\w,-]+)\]'", install).group(1).split(",")
    assert tuple(extras) == IMAGE_EXTRAS
    assert set(extras) <= set(pyproject()["project"]["optional-dependencies"])
    assert "--constraint constraints.txt" in install
    expected = {name: version.split("+")[0] for name, version in installed_closure().items()}
    pinned = read_pins(CONSTRAINTS.read_text())
    assert pinned == expected, ("launch/docker/constraints.txt differs from the versions the tests run with; "
                                "write it again: python -m tests.helpers.constraints > launch/docker/constraints.txt")


def test_the_base_image_is_the_python_release_the_tests_run_on():
    (base,) = [arguments for name, arguments in instructions() if name == "FROM"]
    assert base == "${PYTHON_IMAGE}"
    image = build_args()["PYTHON_IMAGE"]
    python = ".".join(map(str, sys.version_info[:3]))
    assert re.fullmatch(rf"python:{re.escape(python)}-slim-\w+", image), f"{image}: pin python:{python}-slim-<debian release>"


def image_user() -> str:
    users = [arguments for name, arguments in instructions() if name == "USER"]
    assert users, "the image runs as root"
    return users[-1]


def test_the_image_runs_as_a_numeric_user_it_creates_not_root():
    user = image_user()
    assert user.isdigit() and int(user) != 0, "a numeric uid lets Kubernetes' runAsNonRoot check it"
    assert any(f"useradd --uid {user} " in arguments for name, arguments in instructions() if name == "RUN")


def test_the_image_runs_a_console_script_of_the_project():
    commands = [json.loads(arguments) for name, arguments in instructions() if name == "CMD"]
    assert len(commands) == 1
    assert commands[0][0] in pyproject()["project"]["scripts"]
    assert commands[0][-3:] == ["-m", "elastictrain", "train"]
