/*
 * admin.h: the admin API (admin.c): view, export and delete dialogs, forget a user,
 * reload the rules; only with CHATGATE_ADMIN_TOKEN set and sent as a bearer token.
 */
#ifndef CHATGATE_ADMIN_H
#define CHATGATE_ADMIN_H

#include <uv.h>
#include <libwebsockets.h>

#define CG_LWS_PROTOCOL_ADMIN "cg-admin"

int cg_admin_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len);
/* lws sizes per-request data with this. */
size_t cg_admin_session_size(void);

#endif
