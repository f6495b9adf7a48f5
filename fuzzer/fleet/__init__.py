"""Fleet campaigns: one campaign across many servers, on Ray (``fuzz campaign --ray --targets FILE``).

ClusterFuzz's shape for slow executions: workers that own their target, a central corpus and
findings store, typed tasks.

- :mod:`fuzzer.fleet.targets` reads the targets file (one entry per server: a URL or a managed
  launch, and where it runs).
- :mod:`fuzzer.fleet.worker` is what runs next to one engine: it opens its target, calibrates
  it, executes traces and judges them by that calibration, confirms candidates. Plain Python;
  Ray makes it an actor.
- :mod:`fuzzer.fleet.pool` is the only module that imports ``ray`` (lazily): it connects,
  places one worker actor per target and waits on their tasks.
- :mod:`fuzzer.fleet.coordinator` keeps the shared corpus, coverage and findings, dispatches
  typed tasks to idle workers and is the only writer of the campaign's database.

``import fuzzer`` never imports ray: without the ``ray`` extra a single-server campaign is
unchanged and ``--ray`` says how to install it.
"""
