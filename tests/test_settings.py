"""The one registry of settings (``cupool.settings``): everything that lists settings derives from it (issue 25)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import cupool
from cupool import settings
from cupool.config import parse_conf

ROOT = Path(__file__).resolve().parent.parent


def test_pools_signature_is_the_registry_in_order_with_its_defaults():
    params = inspect.signature(cupool.Pool).parameters
    assert tuple(params) == settings.names()
    assert {n: p.default for n, p in params.items()} == {s.name: s.default for s in settings.SETTINGS}


def test_pool_config_reports_every_setting():
    pool = cupool.Pool("sim", capacity="64MiB")
    assert set(settings.names()) - {"track_sites", "spill", "spill_policy"} <= set(pool.config)


def test_cupool_conf_takes_exactly_the_registrys_conf_keys():
    for s in settings.SETTINGS:
        sample = {"size": "1GiB", "fraction": "0.5", "threshold": "0.2", "flag": "true", "text": "host"}.get(
            s.kind, s.choices[0] if s.choices else "")
        assert parse_conf(f"{s.name}={sample}") == {s.name: s.parse(sample)}
    with pytest.raises(ValueError, match="unknown key 'stich'.*known keys: .*stitch"):
        parse_conf("stich=true")


@pytest.mark.parametrize("name,text,message", [
    ("max_size", "lots", "max_size"), ("memory_fraction", "1.5", r"memory_fraction: must be in \(0, 1\]"),
    ("defrag_threshold", "1", r"must be in \[0, 1\) or none"), ("stitch", "yes", "stitch: must be true or false"),
    ("spill_policy", "random", "spill_policy: must be lru, fifo or adaptive"),
])
def test_a_bad_value_names_its_setting(name, text, message):
    with pytest.raises(ValueError, match=message):
        settings.BY_NAME[name].parse(text)


def test_an_unset_follower_follows_what_is_given():
    recorded = {"expandable_segments": True, "stitch": True, "max_size": "1GiB"}
    assert settings.resolve_derived({"expandable_segments": False}, recorded) == {
        "expandable_segments": False, "stitch": None, "max_size": "1GiB"}
    assert settings.resolve_derived({"expandable_segments": False, "stitch": False}, recorded)["stitch"] is False
    assert settings.resolve_derived({"max_size": "2GiB"}, recorded)["stitch"] is True


def test_the_dask_preload_has_an_option_for_every_setting():
    pytest.importorskip("distributed", reason="cupool.dask needs distributed (pip install distributed)")
    from cupool.dask import dask_setup

    flags = {opt.lstrip("-") for p in dask_setup.params for opt in p.opts}
    for name in settings.names():
        if name != "track_sites":  # a debugging aid of one process
            assert "cupool-" + name.replace("_", "-") in flags, name


def test_the_readme_lists_the_cupool_conf_keys():
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "CUPOOL_CONF=" in x and "keys:" in x)
    keys = re.search(r"\(keys: ([^;]*);", line).group(1)
    assert [k.strip(" `") for k in keys.split(",")] == list(settings.names(conf=True))


@pytest.mark.parametrize("kw, said", [
    ({"capacity": "1GiB", "max_size": "2GiB"}, "max_size: '2GiB' is more than the 1 GiB (1073741824 bytes)"),
    ({"max_size": "6GiB"}, "max_size: '6GiB' is more than the 4 GiB"),  # the sim device's default size
    ({"capacity": "64MiB", "max_size": 64 * 2**20 + 1}, "max_size: 67108865 is more than the 64 MiB (67108864 "),
])
def test_a_max_size_past_the_device_is_refused_naming_it(kw, said):
    """A cap the device can never reach caps nothing: it was a typo or the wrong device (issue 36 #19)."""
    with pytest.raises(ValueError, match=re.escape(said)):
        cupool.Pool("sim", **kw)
    assert cupool.Pool("sim", capacity="1GiB", max_size="1GiB").limit == 2**30  # the whole device is a cap
    # Managed memory holds more than the device: its own total is the bound.
    assert cupool.Pool("sim", capacity="64MiB", upstream="managed", expandable_segments=False,
                       max_size="96MiB").limit == 96 * 2**20
