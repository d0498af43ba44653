"""A small copy of Tornado's WebSocket chat demo (demos/websocket/chatdemo.py in Tornado's
repository), for the drop-in tests (tests/e2e/test_dropin_tornado.py): an app someone else
wrote, run unchanged behind chatgate.

What it keeps of the demo, as the demo has it:
- `GET /`: the page, the cached messages and a form whose text field is `body` (the demo's
  chat.js sends the form as JSON, `{"body": "..."}`, over `ws://" + location.host +
  "/chatsocket"`); no jQuery or script here, the tests are the clients;
- `/chatsocket`: a `tornado.websocket.WebSocketHandler` that keeps every open connection in
  `waiters` (added in `open`, removed in `on_close`), and for each message
  `{"body": ...}` builds `{"id": uuid4, "body": ..., "html": <div class="message"
  id="m<id>">linkified body</div>}`, keeps it in a cache of the last 200 and writes it to
  every waiter (the sender included);
- Tornado's own `check_origin`, not overridden: a handshake with an `Origin` whose host:port
  is not the request's `Host` header is refused with HTTP 403;
- compression offered to clients that ask (`get_compression_options` returns `{}`).

The state (waiters, cache) belongs to one `make_app()` (the demo keeps it in class
attributes; here each app gets its own handler class, so two apps in one process do not share
a chat room).

Run it as a program: `/usr/bin/python3 tests/e2e/tornado_chat.py --port 0` listens on
127.0.0.1 (port 0: a free one), prints `listening on 127.0.0.1:PORT` on stdout and logs as the
demo does on stderr. Or in-process, on a running asyncio loop: `server, port = await
start(port=0)`, then `server.stop()`.
"""

import argparse
import asyncio
import logging
import sys
import uuid

import tornado.escape
import tornado.httpserver
import tornado.netutil
import tornado.template
import tornado.web
import tornado.websocket

log = logging.getLogger("chatdemo")

TEMPLATES = {
    "index.html": """<!DOCTYPE html>
<html>
  <head><meta charset="UTF-8"><title>Tornado Chat Demo</title></head>
  <body>
    <div id="inbox">
      {% for message in messages %}{% include "message.html" %}{% end %}
    </div>
    <form action="/a/message/new" method="post" id="messageform">
      <input type="text" name="body" id="message">
      <input type="submit" value="Post">
      <input type="hidden" name="next" value="{{ request.path }}">
    </form>
  </body>
</html>
""",
    "message.html": """{% import tornado.escape %}<div class="message" id="m{{ message["id"] }}">"""
                    """{% raw tornado.escape.linkify(message["body"]) %}</div>
""",
}


class ChatSocketBase(tornado.websocket.WebSocketHandler):
    """The demo's ChatSocketHandler; `make_app` gives each app a subclass with its own
    `waiters` and `cache`."""

    waiters = set()
    cache = []
    cache_size = 200

    def get_compression_options(self):
        return {}  # not None: permessage-deflate for the clients that offer it

    def prepare(self):
        # not the demo's: a cookie set on the handshake's 101, which a proxy must pass on
        self.set_cookie("chat_seen", "1")

    def open(self):
        type(self).waiters.add(self)

    def on_close(self):
        type(self).waiters.discard(self)

    @classmethod
    def update_cache(cls, chat):
        cls.cache.append(chat)
        if len(cls.cache) > cls.cache_size:
            cls.cache = cls.cache[-cls.cache_size:]

    @classmethod
    def send_updates(cls, chat):
        log.info("sending message to %d waiters", len(cls.waiters))
        for waiter in list(cls.waiters):
            try:
                waiter.write_message(chat)
            except Exception:
                log.error("Error sending message", exc_info=True)

    def on_message(self, message):
        log.info("got message %r", message)
        parsed = tornado.escape.json_decode(message)
        chat = {"id": str(uuid.uuid4()), "body": parsed["body"]}
        chat["html"] = tornado.escape.to_basestring(self.render_string("message.html", message=chat))
        cls = type(self)
        cls.update_cache(chat)
        cls.send_updates(chat)


def make_app():
    class ChatSocketHandler(ChatSocketBase):
        waiters = set()
        cache = []

    class MainHandler(tornado.web.RequestHandler):
        def get(self):
            self.render("index.html", messages=ChatSocketHandler.cache)

    app = tornado.web.Application(
        [(r"/", MainHandler), (r"/chatsocket", ChatSocketHandler)],
        cookie_secret=uuid.uuid4().hex,
        template_loader=tornado.template.DictLoader(TEMPLATES))
    app.chat_handler = ChatSocketHandler
    return app


async def start(port=0, host="127.0.0.1"):
    """Serve a new app on the running loop: (the HTTPServer, its port)."""
    sockets = tornado.netutil.bind_sockets(port, host)
    server = tornado.httpserver.HTTPServer(make_app())
    server.add_sockets(sockets)
    return server, sockets[0].getsockname()[1]


async def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8888, help="0: any free port (printed)")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _, port = await start(args.port, args.host)
    print(f"listening on {args.host}:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
