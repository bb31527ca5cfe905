"""The tools above the lab, one command each (`amp_lab doctor|report|bench|audit|numerics`): they
build and read runs through the lab below and never the other way round (tests/test_layers.py)."""
