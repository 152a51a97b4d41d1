"""The plug-in interfaces (``rlreplay.hookspecs``) and their one loader (``rlreplay.plugins``): every
built-in plug-in implements its kind's interface, and an installed distribution's entry points are
found in each kind's groups, the adapters' former group too."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from rlreplay import hookspecs, plugins

ROOT = Path(__file__).resolve().parents[1]
INTERFACES = {
    "adapters": hookspecs.FrameworkAdapter,
    "uploaders": hookspecs.Uploader,
    "checks": hookspecs.Check,
}


@pytest.mark.parametrize("kind", sorted(INTERFACES))
def test_every_built_in_plug_in_implements_its_interface(kind: str) -> None:
    """The built-ins are pyproject.toml's entry points, found in the installed metadata (here the
    editable install's): no second list."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    builtins = declared[hookspecs.GROUPS[kind][-1]]
    assert {n: plugins.specs(kind)[n] for n in builtins} == builtins
    for name, spec in builtins.items():
        obj = plugins.load(spec)
        if kind == "adapters":
            obj = obj()  # an adapter class, instantiated once by the registry
        assert isinstance(obj, INTERFACES[kind]), (kind, name)
        if kind == "checks":
            assert obj.name == name
        else:
            assert getattr(obj, "name" if kind == "adapters" else "backend") == name


def test_each_kind_is_read_from_its_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution on the path (a dist-info, as pip installs it) registering one plug-in of each
    kind, the adapter in the former group ``rlreplay.recorders``: each is found under its kind."""
    dist = tmp_path / "extras-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: extras\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[rlreplay.recorders]\nold_fw = extras:OldAdapter\n"
        "[rlreplay.uploaders]\nspool = extras:Spool\n"
        "[rlreplay.checks]\nlong_prompt = extras:LONG_PROMPT\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hookspecs.GROUPS["adapters"] == ("rlreplay.recorders", "rlreplay.adapters")
    assert plugins.specs("adapters")["old_fw"] == "extras:OldAdapter"
    assert plugins.specs("uploaders")["spool"] == "extras:Spool"
    assert plugins.specs("checks")["long_prompt"] == "extras:LONG_PROMPT"
    assert "old_fw" not in plugins.specs("uploaders") and "spool" not in plugins.specs("checks")
