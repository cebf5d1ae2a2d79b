"""`Job`: what a command asks a runner to do, as data: the one request of `run`, `parallel`, `chain`,
`workflow` and `resume`, whether it runs in this process or in `subagent serve`.

The CLI builds a `Job` from its arguments and either runs it here (`await job.run(runner)`) or sends
it, as JSON, to the server of the state folder, which runs it the same way on its shared hosts: the
same request in both places, so both give the same results, transcripts and exit codes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from ..caps import DEFAULT_CONCURRENCY
from ..results import MultiRunResult, RunResult
from .tasks import TaskSpec

if TYPE_CHECKING:  # a job sent to the server is built and read without a runner
    from .runner import Runner

Command = Literal["run", "parallel", "chain", "workflow", "resume"]


class Job(BaseModel):
    """One command's request.

    Args:
        tasks: the task (`run`), the tasks (`parallel`) or the steps (`chain`), labelled.
        workflow: the workflow file (`workflow`), found by the command in its workspace.
        input: the workflow's input.
        run_id, message, task, schema: what `resume` continues, with which message, which of the
            run's tasks, and the schema its answer must satisfy.
    """

    command: Command
    tasks: list[TaskSpec] = Field(default_factory=list)
    concurrency: int = DEFAULT_CONCURRENCY
    workflow: str | None = None
    input: str = ""
    run_id: str | None = None
    message: str = ""
    task: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    model_config = {"populate_by_name": True}

    @property
    def single(self) -> bool:
        """Whether it gives one task's result (`run`, `resume`) rather than a run of several."""
        return self.command in ("run", "resume")

    async def run(self, runner: Runner) -> RunResult | MultiRunResult:
        """Run the request on `runner`, as the command would in its own process."""
        if self.command == "run":
            return await runner.run(self.tasks[0])
        if self.command == "parallel":
            return await runner.parallel(self.tasks, concurrency=self.concurrency)
        if self.command == "chain":
            return await runner.chain(self.tasks)
        if self.command == "workflow":
            from .workflow import load_workflow

            flow = load_workflow(Path(self.workflow or ""))
            return await runner.workflow(flow, self.input, concurrency=self.concurrency)
        return await runner.resume(self.run_id or "last", self.message, task=self.task, schema=self.schema_)

    def result(self, data: dict[str, Any]) -> RunResult | MultiRunResult:
        """The result a server sent for this job, as the runner returned it there."""
        return (RunResult if self.single else MultiRunResult).model_validate(data)
