"""The disposable local Ceph cluster for the demo and the tests."""
