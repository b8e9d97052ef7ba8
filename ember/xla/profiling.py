"""profile.step / profile.steps on the XLA path: a jax.profiler trace of those steps (the devices' XLA ops, not
torch's: torch.profiler would see only the host), one per host, for TensorBoard's profiler plugin or XProf."""

from __future__ import annotations

import contextlib

from ember.metrics.profiling import StepProfiler


class JaxStepProfiler(StepProfiler):
    """StepProfiler's window and notices (`plan`), with jax.profiler doing the tracing."""

    def start_step(self, step: int) -> None:
        import jax

        if self._prof is not None and step > self.last:
            self.finish(step - 1)
        if self.enabled and step == self.first and self._prof is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.folder / f"host{self.rank}"))
            self._prof = True

    def step_range(self, step: int) -> contextlib.AbstractContextManager:
        import jax

        return jax.profiler.StepTraceAnnotation("ember/step", step_num=step) if self._prof else contextlib.nullcontext()

    def finish(self, last_step: int) -> None:
        import jax

        if self._prof is None:
            return
        self._prof = None
        jax.profiler.stop_trace()
        self.say(f"profile: jax.profiler trace of steps {self.first}-{last_step} in {self.folder / f'host{self.rank}'} "
                 "(TensorBoard's profiler plugin or XProf)")
