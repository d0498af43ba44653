/*
 * replay.h: `chatgate rules replay --old DIR --new DIR TRANSCRIPT...` (docs: rules/README.md,
 * "Replay before deploy"): recorded conversations run through two rule sets, to see before a
 * deploy which turns a change of the rules would decide differently.
 *
 * A transcript is JSON lines, one message a line ({"dialog", "text", "ts"}, optionally
 * "role": "assistant" with the state directive the app sent), or the admin API's export of
 * one dialog (GET /admin/dialogs/{user}/{room}). Every dialog keeps one state per rule set,
 * each evolving from its own decisions, so a change shows on the turn it hits and on the
 * later turns it sends elsewhere. A turn's outcome is what the gateway decides before the
 * message goes upstream: the rules that fired, the dialog's params after it, the resolution,
 * the route, the enriched text (and annotations, and a refusal of params over the cap).
 */
#ifndef CHATGATE_DIALOG_REPLAY_H
#define CHATGATE_DIALOG_REPLAY_H

#include <stdint.h>
#include <stdio.h>

#include "chatgate/dialog/rules.h"

/* cg_replay_run's results, which are also `chatgate rules replay`'s exit status */
#define CG_REPLAY_SAME 0        /* no turn differs */
#define CG_REPLAY_DIFFERENT 1   /* some turn differs */
#define CG_REPLAY_BAD_INPUT 2   /* a transcript could not be read (nothing was replayed) */

typedef struct cg_replay_options {
    const cg_ruleset *old_rules, *new_rules;
    int64_t start; /* unix seconds: the clock of a dialog whose first lines have no "ts" */
    FILE *out;     /* the differing turns, then the summary line */
    FILE *err;     /* "file:line: message" of a bad transcript; refused state directives */
} cg_replay_options;

typedef struct cg_replay_totals {
    long transcripts, dialogs, turns, differing;
} cg_replay_totals;

/*
 * Reads and checks every transcript of paths, then replays them in order (each dialog's
 * lines in file order), printing each turn whose outcome differs and the summary. Returns
 * CG_REPLAY_SAME, CG_REPLAY_DIFFERENT or CG_REPLAY_BAD_INPUT; totals may be NULL.
 */
int cg_replay_run(const cg_replay_options *opt, char *const *paths, int n_paths, cg_replay_totals *totals);

#endif
