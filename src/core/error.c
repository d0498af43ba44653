/*
 * error.c: names for the error codes of error.h, taken from the one table there.
 */
#include "chatgate/core/error.h"

const char *cg_err_code(int err)
{
    switch (err) {
#define CG__ERR_CODE(name, code, text) case CG_E_##name: return code;
        CG_ERR_MAP(CG__ERR_CODE)
#undef CG__ERR_CODE
    default: return "internal";
    }
}

const char *cg_strerror(int err)
{
    if (err == CG_OK)
        return "ok";
    switch (err) {
#define CG__ERR_TEXT(name, code, text) case CG_E_##name: return text;
        CG_ERR_MAP(CG__ERR_TEXT)
#undef CG__ERR_TEXT
    default: return "unknown error";
    }
}
