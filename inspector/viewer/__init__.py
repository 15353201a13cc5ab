"""What the app shows and does, without Qt: the runs on show and their selections, the controller (its
jobs: the engine with its state and enablement table, the runs, generating, experiments), what each tab
draws (``tabs``), the interventions table's rows, and the jobs that run off the GUI thread.
``inspector.ui`` draws it; tests drive it without a display."""
