"""OpenAI's Batch API (`/v1/files` + `/v1/batches`) on the router and on `kvloop serve`.

    config.py   BatchConfig: where files live, their bounds, lines in flight
    shapes.py   OpenAI's objects (file, batch, list page, output lines), ids, owners
    store.py    files in a directory; metadata in the directory or in Redis; claims
    journal.py  one batch's results, appended and fsynced before a line counts as done
    runner.py   validates, orders (shared prefixes together), runs and finalizes batches
    routes.py   the HTTP routes (Starlette) a front adds to its route table
    inproc.py   sends one line through the front's own app, in-process

Owner: `BatchService` (routes.py) owns the store and the runner; the runner owns the running
batches' tasks; only the runner changes a batch's status after `validating`, only the cancel
route sets `cancelling`. This package stands below `kvloop.router` and `kvloop.server` and
imports neither: a front hands it a way to send one line (`inproc.asgi_sender`) and the flow
header that puts a line in the batch band.
"""
