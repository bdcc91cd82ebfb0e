"""rbd-reconciler: converge Ceph RBD volumes on bare nodes to desired YAML files."""

__version__ = "0.1.0"
