"""The project's performance page: ``docs/performance.md`` written from the results a ``nemo-is bench`` run saved.

Tooling of this repository, not of the installed package (a user's ``nemo-is bench`` prints its tables and writes its
JSON and figures; splicing them into the project's docs is the maintainers' step):

    python -m tools.bench_docs cpu        bench_results/results.json     # the CPU page (keeps the GPU sections)
    python -m tools.bench_docs head       runs/gpu_check/head/results.json
    python -m tools.bench_docs model-step runs/gpu_check/step/model_step.json
    python -m tools.bench_docs host-heads runs/gpu_check/host_heads/host_heads.json

``performance_page.py`` renders the CPU page, ``gpu_sections.py`` the GPU sections and their markers (a GPU section
is written only from a real, non ``--quick`` GPU run), ``host_heads_section.py`` the hosts' heads section.
"""
