"""Optional kernel backends. Each module registers implementations for ops declared in
``mindspeed.ops``; each probes its vendor library lazily, so importing them is harmless on
machines without it. Vendor modules may name their device family (they are on the
device-name allowlist of tests/sanity/test_device_names.py)."""
