"""The archive formats a build is packed in, and the file name suffix of each (read by the packer, the manifest's
checks and the configuration schema)."""

FORMATS = ("tar.zst", "tar.gz", "tar")
SUFFIX = {"tar.zst": ".tar.zst", "tar.gz": ".tar.gz", "tar": ".tar"}
