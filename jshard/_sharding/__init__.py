"""The sharded tree: policies, meshes, per-leaf layouts, the unit node, the global view."""
