"""What a build becomes on disk and on the wire: the archive of rank files, its manifest, and the manifest's signature.
"""
