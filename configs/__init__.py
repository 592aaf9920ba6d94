"""YAML configurations; `default.yaml` is the embedded default job."""
