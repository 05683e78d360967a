"""AppTables: the app's shared tables (the engine metrics board, the traffic trace, the
Responses API's store) in one Serve deployment, one actor.

Each table is a plain object with async methods; one actor holds them all because every Ray
actor costs the host CPU and memory even when idle (its core worker's threads, Serve's
replica loops: on a two-core host that CPU is taken from the engine's steps), and these tables
do almost nothing. Callers hold a Table, which reads as the table's own handle would:
`await table.method.remote(*args)`.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentResponse


@serve.deployment(name="AppTables", num_replicas=1, max_ongoing_requests=4096)
class AppTables:
    def __init__(self, tables: dict[str, Any]) -> None:
        """`tables`: name -> the table object (pickled here from the builder)."""
        self._tables = tables

    async def call(self, table: str, method: str, *args: Any) -> Any:
        return await getattr(self._tables[table], method)(*args)


class Table:
    """One table of an AppTables deployment, called as its handle would be:
    `table.push.remote(...)` calls `push` of the table named `name`. Built around the
    deployment's Application in the builder; Serve swaps that for a DeploymentHandle where
    a replica receives it, as it does for any Application among a deployment's arguments."""

    def __init__(self, handle: Any, name: str) -> None:
        self.handle, self.name = handle, name

    def __getattr__(self, method: str) -> _TableMethod:
        if method.startswith("_"):  # pickle and copy look these up: not methods of the table
            raise AttributeError(method)
        return _TableMethod(self, method)


class _TableMethod:
    def __init__(self, table: Table, method: str) -> None:
        self.table, self.method = table, method

    def remote(self, *args: Any) -> DeploymentResponse:
        return self.table.handle.call.remote(self.table.name, self.method, *args)
