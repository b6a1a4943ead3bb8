"""The docs: the mkdocs site builds with --strict, its config reference is every key of the schema,
the README stays a front door, and every relative link in the Markdown resolves."""

from __future__ import annotations

import html
import importlib
import importlib.util
import logging
import re
from pathlib import Path

import pytest
import yaml

from elastictrain.core.config import Config

REPO_ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 260
# Markdown whose relative links must resolve: the front door, the site, and the READMEs that point into it.
LINKED_MARKDOWN = [REPO_ROOT / "README.md", REPO_ROOT / "launch" / "README.md", REPO_ROOT / "benchmarks" / "README.md",
                   *sorted((REPO_ROOT / "docs").rglob("*.md"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `mkdocs build --strict` writes it: a warning (a broken link or anchor, a page out of the nav) fails it."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    site_dir = tmp_path_factory.mktemp("site")
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Collect()
    logging.getLogger("mkdocs").addHandler(handler)
    try:
        build(load_config(str(REPO_ROOT / "mkdocs.yml"), strict=True, site_dir=str(site_dir)))
    except Abort as exc:
        pytest.fail(f"mkdocs build --strict failed ({exc}):\n" + "\n".join(warnings))
    finally:
        logging.getLogger("mkdocs").removeHandler(handler)
    assert not warnings, warnings
    return site_dir


def _leaf_keys(tree: dict, prefix: str = "") -> dict[str, object]:
    """Dotted key -> default for every leaf of the config (an empty mapping such as task.args is a leaf)."""
    leaves = {}
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            leaves.update(_leaf_keys(value, f"{prefix}{name}."))
        else:
            leaves[f"{prefix}{name}"] = value
    return leaves


def _reference_rows(site: Path) -> dict[str, list[str]]:
    """Dotted key -> the text of its row's cells, from the built config reference page."""
    page = (site / "reference" / "config" / "index.html").read_text()
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", page, re.S):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip() for cell in re.findall(r"<td>(.*?)</td>", row, re.S)]
        if cells:
            rows[cells[0]] = cells[1:]
    return rows


def test_config_reference_lists_every_key_with_its_default_and_no_other(site):
    expected = _leaf_keys(Config().model_dump(mode="json"))
    rows = _reference_rows(site)
    assert sorted(rows) == sorted(expected), (
        f"missing from the reference: {sorted(set(expected) - set(rows))}; not in the schema: {sorted(set(rows) - set(expected))}"
    )
    assert "watchdog.hang_timeout_s" in rows and "stragglers.factor" in rows  # the sections the old hand-written table lacked
    for key, default in expected.items():
        type_text, default_text, _description = rows[key]
        assert yaml.safe_load(default_text) == default, f"{key}: the reference says {default_text!r}, the schema {default!r}"
        assert type_text, key


def test_config_reference_describes_nearly_every_key(site):
    rows = _reference_rows(site)
    undescribed = sorted(key for key, cells in rows.items() if not cells[2])
    assert len(undescribed) <= 3, f"keys with no comment in elastictrain/core/config.py or conf/default.yaml: {undescribed}"


SCHEMA_SOURCE = '''
from pydantic import BaseModel, Field


class Tier(BaseModel):
    """Where one tier's copies go."""

    url: str | None = None  # a trailing comment
    # Comment lines above a field,
    # two of them.
    every_s: float = 0.0  # and a trailing one
    keep: int = Field(2, ge=1, description="from Field(description=)")  # not this comment


class Root(BaseModel):
    # held by a field whose class has no docstring
    durable: Tier = Field(default_factory=Tier)
    plain: bool = True
'''


def test_config_reference_hook_reads_every_kind_of_description_and_walks_sub_sections(tmp_path, monkeypatch):
    (tmp_path / "fake_schema.py").write_text(SCHEMA_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_schema = importlib.import_module("fake_schema")
    spec = importlib.util.spec_from_file_location("config_reference", REPO_ROOT / "docs" / "hooks" / "config_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    markdown = hook.render(fake_schema.Root, fake_schema.Root().model_dump(mode="json"))
    assert "| `plain` | bool | `true` |  |" in markdown
    assert "## durable\n\nWhere one tier's copies go." in markdown
    assert "| `durable.url` | string or null | `null` | a trailing comment |" in markdown
    assert "| `durable.every_s` | float | `0.0` | Comment lines above a field, two of them. and a trailing one |" in markdown
    assert "| `durable.keep` | int ≥ 1 | `2` | from Field(description=) |" in markdown


def test_the_config_reference_in_the_repository_is_the_one_the_site_renders():
    spec = importlib.util.spec_from_file_location("config_reference", REPO_ROOT / "docs" / "hooks" / "config_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (REPO_ROOT / "docs" / "reference" / "config.md").read_text()
    assert hook.END in page, "docs/reference/config.md holds no generated tables: run python docs/hooks/config_reference.py"
    assert hook.page_text(page) == page, ("docs/reference/config.md is behind elastictrain/core/config.py: run "
                                          "python docs/hooks/config_reference.py and commit the page")


def test_every_config_key_the_docs_name_exists():
    """A key named in prose (`snapshot.durable.keep_last`, `train.scale_lr=true`) must be one the schema has, so a renamed key cannot
    leave the guides behind. Free-form mappings (task.args, snapshot.durable.storage_options) take any key below them.
    Python and diff blocks are code, where `dist.init_process_group` is torch's, not a config key."""
    valid = set()
    for key in _leaf_keys(Config().model_dump(mode="json")):
        parts = key.split(".")
        valid.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    free_form = tuple(f"{key}." for key, value in _leaf_keys(Config().model_dump(mode="json")).items() if value == {})
    named = re.compile(rf"(?<![\w/.<-])((?:{'|'.join(Config.model_fields)})\.[a-z_]+(?:\.[a-z_]+)*)")
    unknown = []
    for markdown in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]:
        text = markdown.read_text()
        for code in re.findall(r"`([^`\n]+)`", text) + re.findall(r"(?ms)^```(?!python|diff)[a-z]*\n(.*?)^```", text):
            if "unknown key" in code:  # the docs' example of a misspelt key
                continue
            unknown += [f"{markdown.relative_to(REPO_ROOT)}: {key}" for key in named.findall(code)
                        if key not in valid and not key.startswith(free_form)]
    assert not unknown, f"config keys the docs name but the schema does not have: {unknown}"


def test_the_api_reference_renders_every_public_name_from_its_docstring(site):
    """docs/reference/api.md is rendered by mkdocstrings from the source: every name of `elastictrain.__all__` is on it,
    an object by its own heading (an id mkdocstrings made from the module it is defined in), and each has its docstring."""
    import elastictrain

    page = (site / "reference" / "api" / "index.html").read_text()
    ids = set(re.findall(r'\bid="(elastictrain\.[\w.]+)"', page))
    source = (REPO_ROOT / "docs" / "reference" / "api.md").read_text()
    missing = [name for name in elastictrain.__all__
               if not any(i.rsplit(".", 1)[-1] == name for i in ids) and f"`elastictrain.{name}" not in source]
    assert not missing, f"public names not on the API reference page: {missing}"
    assert "One process's part of an elastictrain run." in html.unescape(re.sub(r"<[^>]+>", "", page))  # Session's docstring


def test_readme_stays_a_front_door():
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (limit {README_MAX_LINES})"


def _links(markdown: str) -> list[str]:
    """Link and image targets outside code blocks and code spans."""
    prose = re.sub(r"(?ms)^```.*?^```", "", markdown)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return [target.split()[0] for target in re.findall(r"\]\(([^)\s]+(?:\s+\"[^\"]*\")?)\)", prose)]


def _anchors(site: Path, page: Path) -> set[str]:
    """The ids on the built page for docs/PAGE.md (mkdocs's use_directory_urls layout)."""
    relative = page.relative_to(REPO_ROOT / "docs").with_suffix("")
    built = site / (relative.parent if relative.name in ("index", "README") else relative) / "index.html"
    return set(re.findall(r'\bid="([^"]+)"', built.read_text()))


@pytest.mark.parametrize("markdown", LINKED_MARKDOWN, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(markdown, site):
    broken = []
    for target in _links(markdown.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page (mkdocs checks those in docs/)
        path_text, _, anchor = target.partition("#")
        path = (markdown.parent / path_text).resolve()
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and (REPO_ROOT / "docs") in path.parents and anchor not in _anchors(site, path):
            broken.append(f"{target} (no such heading on the built page)")
    assert not broken, f"{markdown.relative_to(REPO_ROOT)}: {broken}"


def test_getting_started_lists_the_built_in_models_state_dict_keys_and_shapes():
    """What `elastictrain snapshots export` writes for the default job: a user loads it by these keys."""
    from elastictrain.train.tasks import spirals

    text = (REPO_ROOT / "docs" / "getting-started.md").read_text()
    documented = {key: tuple(int(n) for n in shape.split(" × "))
                  for key, shape in re.findall(r"^\| `(layers\.[\w.]+)` \| ([\d × ]+?) \|$", text, re.M)}
    model = spirals.build().model
    assert documented == {key: tuple(value.shape) for key, value in model.state_dict().items()}
