"""The search page in a real browser: Debian's headless Chromium driven by its chromedriver
through Selenium types a question and reads the results the page shows.

With EMBEDINGEST_SCREENSHOT=path.png the page with its results is saved there (how
docs/serve-page.png was made).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.request

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [pytest.mark.needs_browser,
              pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                 reason="needs Debian's chromium and chromium-driver (apt-get install)")]
pytest.importorskip("selenium")
uvicorn = pytest.importorskip("uvicorn")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from server import free_port  # noqa: E402
from test_app import PARAGRAPHS, make_corpus  # noqa: E402

from embedingest import build_index, open_index  # noqa: E402
from embedingest.serve.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The app on uvicorn in a thread of this process, on a free loopback port."""
    root = tmp_path_factory.mktemp("browser")
    build_index(make_corpus(root / "corpus"), out=str(root / "idx"), num_workers=0, num_consumers=1,
                batch_size=8)
    with open_index(root / "idx") as index:
        index.search(["load the model"], k=1)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(index), host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        yield f"http://127.0.0.1:{port}"
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
                 "--window-size=1100,760"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_typing_a_question_shows_the_results(url, browser):
    browser.get(url + "/")
    wait = WebDriverWait(browser, 20)
    wait.until(EC.text_to_be_present_in_element((By.ID, "about"), "chunks"))
    assert "5 chunks" in browser.find_element(By.ID, "about").text
    box = browser.find_element(By.ID, "q")
    box.send_keys("how do whales breathe", Keys.ENTER)
    wait.until(EC.text_to_be_present_in_element((By.ID, "status"), "results in"))
    hits = browser.find_elements(By.CSS_SELECTOR, "#results li.hit")
    assert len(hits) == 5  # the whole little index, best first
    first = hits[0]
    source = first.find_element(By.CSS_SELECTOR, ".source")
    assert source.text == "whales.txt" and source.tag_name == "a"
    assert first.find_element(By.CSS_SELECTOR, ".text").text == PARAGRAPHS["whales.txt"]
    marks = [m.text.lower() for m in first.find_elements(By.TAG_NAME, "mark")]
    assert marks == ["whales", "breathe"]  # the query's words, highlighted in the chunk
    bread = next(h for h in hits if "bread.txt" in h.text)
    assert bread.find_elements(By.TAG_NAME, "mark") == []  # whole words only: not "do" in "dough"
    assert "characters 0–" in first.text and first.find_element(By.CSS_SELECTOR, ".rank").text == "#1"
    with urllib.request.urlopen(source.get_attribute("href"), timeout=10) as r:  # the link serves the file
        assert r.read().decode() == PARAGRAPHS["whales.txt"]
    record = next(h for h in hits if "records.jsonl" in h.text)
    assert "record v1" in record.text or "record e1" in record.text
    assert "q=how+do+whales+breathe" in browser.current_url.replace("%20", "+")
    if os.environ.get("EMBEDINGEST_SCREENSHOT"):
        browser.save_screenshot(os.environ["EMBEDINGEST_SCREENSHOT"])


def test_the_page_shows_why_a_query_is_refused(url, browser):
    browser.get(url + "/?q=%20%20")
    wait = WebDriverWait(browser, 20)
    wait.until(EC.text_to_be_present_in_element((By.ID, "status"), "error"))
    assert "the query is empty" in browser.find_element(By.ID, "status").text
    assert browser.find_elements(By.CSS_SELECTOR, "#results li") == []
