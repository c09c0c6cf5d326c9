"""`plait check`: a fault-injection checker that runs real writer and reader processes
against PostgreSQL and a transport, breaks them on a schedule, and checks every row.

`plan` says what to run, `roles` are the processes, `faults` breaks them, `journal`
holds what each one recorded, `verdict` judges it (pure), `run` ties them together.
"""
