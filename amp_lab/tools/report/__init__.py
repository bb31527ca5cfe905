"""`amp_lab report`: finished runs read back from their directories and compared side by side."""
