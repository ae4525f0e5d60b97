"""The profiler's section (metrics.py)."""

from MaxText.sections import Section

PROFILERS = ("", "xplane")  # `profiler`: none, or a JAX (XPlane) trace that TensorBoard's profile plugin reads

SECTION = Section(name="profiler", keys=("profiler", "profiler_steps"), choices={"profiler": PROFILERS})
