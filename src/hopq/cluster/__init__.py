"""Running several ranks on one machine: the emulated network (:mod:`.network`:
namespaces, veth links, ``tc tbf``) and the process launcher (:mod:`.launch`)
used by the main job, the benchmarks and the tests. Torch only."""
