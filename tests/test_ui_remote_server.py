"""The window on a server it did not start (``inspector serve`` of the fake engine in a child process):
what it says and keeps when that server goes away (issue 38)."""

from PySide6.QtWidgets import QMessageBox

from fake_server import fake_server
from inspector.ui.connect_dialog import ConnectDialog
from ui_fixtures import fail_on_qt_warnings, make_window, ui_settings, wait_state  # noqa: F401

HOOK = "model.layers.0.resid_post"


def hook_label(window, row: int) -> str:
    model = window.interventions.model
    return model.data(model.index(row, 1))


def button(box: QMessageBox, text: str):
    return next(b for b in box.buttons() if b.text() == text)


def test_restarting_a_dead_servers_engine_says_so_and_keeps_what_the_window_knew(qtbot, ui_settings):
    with fake_server(model="tiny-remote") as (url, process):
        window = make_window(qtbot, boot=False)
        window.connect(url)
        wait_state(qtbot, window, "ready")
        hooks = window.tree.hook_names()
        row = window.interventions.add_row(HOOK)
        short = hook_label(window, row)
        title = f"tiny-remote (compiled) on {url}"
        assert short != HOOK and window.windowTitle() == title
        process.kill()
        process.wait()
    wait_state(qtbot, window, "dead")
    assert "The engine is gone" in window.last_dialog.text()
    window.last_dialog.close()

    window.restart_engine()  # Engine ▸ Restart Engine
    box = window.last_dialog
    assert box.windowTitle() == "Server unreachable" and url in box.text()
    assert window.state.value == "dead", "the dead address must not be dialled without asking"
    assert window.tree.hook_names() == hooks and hook_label(window, row) == short and window.windowTitle() == title

    button(box, "Other Server…").click()  # the dialog to choose another
    dialogs = window.findChildren(ConnectDialog)
    assert dialogs and dialogs[-1].isVisible() and dialogs[-1].url.text() == url
    dialogs[-1].reject()

    window.restart_engine()
    with fake_server(listen=url, model="tiny-remote"):  # the server is back: Reconnect reaches it
        button(window.last_dialog, "Reconnect").click()
        assert window.state.value == "booting"
        assert window.tree.hook_names() == hooks and hook_label(window, row) == short  # until it is up
        wait_state(qtbot, window, "ready")
        assert window.tree.hook_names() == hooks and hook_label(window, row) == short
        assert window.windowTitle() == title


def test_a_server_that_cannot_be_reached_keeps_the_last_catalogue_and_titles_the_window_once(qtbot, ui_settings):
    with fake_server(model="tiny-remote") as (url, process):
        window = make_window(qtbot, boot=False)
        window.connect(url)
        assert window.windowTitle() == url  # no model known yet: the address alone
        wait_state(qtbot, window, "ready")
        hooks = window.tree.hook_names()
        row = window.interventions.add_row(HOOK)
        short = hook_label(window, row)
        process.kill()
        process.wait()
    wait_state(qtbot, window, "dead")
    window.last_dialog.close()
    window.restart_engine()
    button(window.last_dialog, "Reconnect").click()
    wait_state(qtbot, window, "no model", timeout=30000)  # nobody answers: given up after the connect deadline
    assert "Could not connect" in window.last_dialog.text() and url in window.last_dialog.text()
    assert window.tree.hook_names() == hooks and hook_label(window, row) == short
    assert window.windowTitle() == f"tiny-remote (compiled) on {url}"
