"""The rotation zoo: Hub releases, the manifest, model cards and the authors' reference format."""
