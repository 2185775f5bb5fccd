"""Debian's Chromium driven by Python playwright, for the UI test (in test_deployments.py, on
that module's Prefect server): its launch settings and the page helpers. `playwright()` skips
the calling test, and only it, where Chromium or playwright is missing."""

import os
import struct

import pytest

# Debian's package (scripts/setup.sh test installs it); STOKER_TEST_CHROMIUM names another binary
CHROMIUM = os.environ.get("STOKER_TEST_CHROMIUM", "/usr/bin/chromium")

# headless on a small CI machine; nothing reaches out of 127.0.0.1
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # no WebGL: the run page's timeline graph (a WebGL canvas, software-rendered by SwiftShader
    # without a GPU) redraws on every frame while a run is Running: ~0.5 CPU s per second there
    # (17 of 30 s measured), most of the UI test's CPU. Nothing it checks is about the graph: its
    # area stays empty, and the rest of the page is the same.
    "--disable-3d-apis",
]


def playwright():
    """playwright.sync_api, or skip the calling test: no Chromium, or no Python playwright."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    return pytest.importorskip("playwright.sync_api", reason="Python playwright is not installed (the [test] extra)")


def dismiss_toasts(page, appear_within_ms: int = 0) -> None:
    """Close the UI's toasts with their close buttons, as a user would: its "Oops. Something
    went wrong." (after a 503) stays until closed, over the cards a test clicks. With
    `appear_within_ms`, first wait that long for one to show."""
    sync_api = playwright()
    closes = page.locator("#prefect-design-toast-app .p-toast__close-btn")
    if appear_within_ms:
        try:
            closes.first.wait_for(timeout=appear_within_ms)
        except sync_api.Error:
            return
    for _ in range(10):
        visible = [c for c in closes.all() if c.is_visible()]
        if not visible:
            return
        try:
            visible[-1].click(timeout=3_000)
        except sync_api.Error:  # gone by itself, or under the other toast layer
            pass


def form_input(page, label: str):
    """The input of the schema form's property labelled `label` (its labels carry no `for`
    that names the input, so: the nearest property container of the label)."""
    return page.locator(
        f"xpath=//span[contains(@class,'schema-form-property__label')][normalize-space()='{label}']"
        "/ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')][1]"
        "//input"
    )


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    return struct.unpack(">II", data[16:24])
