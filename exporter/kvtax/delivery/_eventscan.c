/* kvtax.delivery._eventscan: scan_ids in C, one native call per read.
 *
 * The same function as kvtax.delivery.eventscan.scan_ids_py, whose docstring says what it
 * does; the two must answer alike for every input (tests/unit/test_eventscan.py holds them to
 * it). This one exists for what it spares: the line reader makes several Python objects per
 * event (slices, match objects, tuples, lists), and that object work, not the searching, is
 * most of the relay's CPU per event. Here each event's end, choice, ids and cuts are found over
 * the read's bytes, and the client's bytes are built in one allocation.
 *
 * Positions follow Python's bytes.find and rfind: a needle is found only wholly inside the
 * range searched. Any read this code is unsure of gets None, and the Python line reader, which
 * is the reference, takes it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define LEN(s) ((Py_ssize_t)(sizeof(s) - 1))

static const char DATA_SPACED[] = "data: {";
static const char DATA_BARE[] = "data:{";
static const char CHOICES[] = "\"choices\":[";
static const char INDEX[] = "{\"index\":";
static const char TERMINAL[] = "\"finish_reason\":\"";
static const char IDS[] = "\"token_ids\":[";
static const char PROMPT_IDS[] = "\"prompt_token_ids\":[";
static const char NULL_IDS[] = "\"token_ids\":null";
static const char NULL_PROMPT_IDS[] = "\"prompt_token_ids\":null";

/* A choice index longer than this is no vLLM's: the line reader takes it (as in Python). */
#define MAX_INDEX_DIGITS 9
/* Events of one read kept on the stack; a read with more grows a heap array. */
#define STACK_EVENTS 16

/* Where one event's cuts go, as offsets into the read. */
typedef struct {
    Py_ssize_t begin, end;          /* the event, without its blank line */
    Py_ssize_t prompt, closed;      /* the prompt's ids list: '[' ... ']' (prompt < 0: none) */
    Py_ssize_t ids, stop;           /* the choice's ids list */
} Event;

/* First `needle` wholly inside s[from:to], or -1. */
static Py_ssize_t
find(const char *s, Py_ssize_t from, Py_ssize_t to, const char *needle, Py_ssize_t m)
{
    if (to - from < m) {
        return -1;
    }
    const char *hit = memmem(s + from, (size_t)(to - from), needle, (size_t)m);
    return hit == NULL ? -1 : hit - s;
}

/* Last `needle` wholly inside s[from:to], or -1. */
static Py_ssize_t
rfind(const char *s, Py_ssize_t from, Py_ssize_t to, const char *needle, Py_ssize_t m)
{
    for (Py_ssize_t at = to - m; at >= from; at--) {
        if (s[at] == needle[0] && memcmp(s + at, needle, (size_t)m) == 0) {
            return at;
        }
    }
    return -1;
}

/* First byte `c` in s[from:to], or -1. */
static Py_ssize_t
find_byte(const char *s, Py_ssize_t from, Py_ssize_t to, char c)
{
    if (to <= from) {
        return -1;
    }
    const char *hit = memchr(s + from, c, (size_t)(to - from));
    return hit == NULL ? -1 : hit - s;
}

/* The ids in s[from:to], a JSON list's inside of integers: its commas and one. */
static long
count_ids(const char *s, Py_ssize_t from, Py_ssize_t to)
{
    if (to <= from) {
        return 0;
    }
    long commas = 0;
    for (const char *p = s + from, *end = s + to; (p = memchr(p, ',', (size_t)(end - p))); p++) {
        commas++;
    }
    return commas + 1;
}

/* The regular expression "choices":\[(?:(\])|\{"index":(\d+)) searched in s[from:to]: its first
 * match's index in *choice and the match's end in *after. Returns 0 on no match, and also when
 * the first match is the empty list (the usage-only chunk), -1 when the index is too long. */
static int
choices_index(const char *s, Py_ssize_t from, Py_ssize_t to, long *choice, Py_ssize_t *after)
{
    for (Py_ssize_t at = find(s, from, to, CHOICES, LEN(CHOICES)); at >= 0;
         at = find(s, at + 1, to, CHOICES, LEN(CHOICES))) {
        Py_ssize_t p = at + LEN(CHOICES);
        if (p < to && s[p] == ']') {
            return 0;
        }
        if (to - p < LEN(INDEX) || memcmp(s + p, INDEX, (size_t)LEN(INDEX)) != 0) {
            continue;
        }
        p += LEN(INDEX);
        Py_ssize_t digits = p;
        long value = 0;
        while (p < to && s[p] >= '0' && s[p] <= '9') {
            if (p - digits >= MAX_INDEX_DIGITS) {
                return -1;
            }
            value = value * 10 + (s[p] - '0');
            p++;
        }
        if (p == digits) {
            continue;
        }
        *choice = value;
        *after = p;
        return 1;
    }
    return 0;
}

/* One event s[b:e]: its cuts in *ev, its choice, tokens and prompt ids (-1: none). Returns 0 if
 * it is not of the shape (the line reader takes the read). */
static int
scan_event(const char *s, Py_ssize_t b, Py_ssize_t e, int include_usage, Event *ev,
           long *choice, long *tokens, long *prompt_tokens)
{
    int data = (e - b >= LEN(DATA_SPACED) && memcmp(s + b, DATA_SPACED, LEN(DATA_SPACED)) == 0)
               || (e - b >= LEN(DATA_BARE) && memcmp(s + b, DATA_BARE, LEN(DATA_BARE)) == 0);
    if (!data) {
        return 0;
    }
    Py_ssize_t ids = rfind(s, b, e, IDS, LEN(IDS));
    if (ids < 0) {
        return 0;
    }
    Py_ssize_t stop = find_byte(s, ids, e, ']');
    Py_ssize_t after;
    if (stop < 0 || choices_index(s, b, ids, choice, &after) != 1) {
        return 0;
    }
    if (!include_usage && find(s, after, ids, TERMINAL, LEN(TERMINAL)) >= 0) {
        return 0;  /* a terminal chunk the fingerprint goes on */
    }
    Py_ssize_t prompt = find(s, b, e, PROMPT_IDS, LEN(PROMPT_IDS));
    if (prompt > ids) {
        return 0;  /* not the shape of vLLM's completions events */
    }
    Py_ssize_t closed = -1;
    *prompt_tokens = -1;
    if (prompt >= 0) {
        closed = find_byte(s, prompt, e, ']');
        if (closed > ids) {
            return 0;  /* the prompt's list does not close before the choice's ids */
        }
        *prompt_tokens = count_ids(s, prompt + LEN(PROMPT_IDS), closed);
    }
    *tokens = count_ids(s, ids + LEN(IDS), stop);
    ev->begin = b;
    ev->end = e;
    ev->prompt = prompt;
    ev->closed = closed;
    ev->ids = ids;
    ev->stop = stop;
    return 1;
}

/* The client's bytes: each event with its ids (and the prompt's) cut to null, and its blank
 * line. */
static PyObject *
cut(const char *s, const Event *events, Py_ssize_t count)
{
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const Event *ev = &events[i];
        size += ev->end - ev->begin + 2 - (ev->stop + 1 - ev->ids) + LEN(NULL_IDS);
        if (ev->prompt >= 0) {
            size += LEN(NULL_PROMPT_IDS) - (ev->closed + 1 - ev->prompt);
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) {
        return NULL;
    }
    char *w = PyBytes_AS_STRING(out);
#define PUT(from, n) (memcpy(w, (from), (size_t)(n)), w += (n))
    for (Py_ssize_t i = 0; i < count; i++) {
        const Event *ev = &events[i];
        Py_ssize_t at = ev->begin;
        if (ev->prompt >= 0) {
            PUT(s + at, ev->prompt - at);
            PUT(NULL_PROMPT_IDS, LEN(NULL_PROMPT_IDS));
            at = ev->closed + 1;
        }
        PUT(s + at, ev->ids - at);
        PUT(NULL_IDS, LEN(NULL_IDS));
        PUT(s + ev->stop + 1, ev->end - ev->stop - 1);
        PUT("\n\n", 2);
    }
#undef PUT
    return out;
}

/* Every event of the read s[0:n], each ending at its blank line, into *events (grown on the
 * heap past STACK_EVENTS). Returns the number of events, 0 if the read is not all events of the
 * shape and of one choice, -1 on a memory error. */
static Py_ssize_t
scan_read(const char *s, Py_ssize_t n, int include_usage, Event **events, Py_ssize_t *room,
          long *choice, long *tokens, long *prompt_tokens)
{
    Py_ssize_t count = 0;
    *choice = -1;
    *tokens = 0;
    *prompt_tokens = -1;
    for (Py_ssize_t b = 0; b < n;) {
        /* An event holds no line break: its first one must start its blank line. */
        Py_ssize_t e = find_byte(s, b, n, '\n');
        if (e < 0 || e + 1 >= n || s[e + 1] != '\n') {
            return 0;
        }
        if (count == *room) {
            Py_ssize_t grown = *room * 4;
            Event *more = PyMem_New(Event, (size_t)grown);
            if (more == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memcpy(more, *events, (size_t)count * sizeof(Event));
            if (*room > STACK_EVENTS) {
                PyMem_Free(*events);
            }
            *events = more;
            *room = grown;
        }
        long one_choice, one_tokens, one_prompt;
        if (!scan_event(s, b, e, include_usage, &(*events)[count], &one_choice, &one_tokens,
                        &one_prompt)) {
            return 0;
        }
        if (*choice >= 0 && one_choice != *choice) {
            return 0;  /* another choice's event: the line reader keeps their order */
        }
        *choice = one_choice;
        *tokens += one_tokens;
        if (one_prompt > *prompt_tokens) {
            *prompt_tokens = one_prompt;
        }
        count++;
        b = e + 2;
    }
    return count;
}

static PyObject *
scan_ids(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "scan_ids(data: bytes, keep_ids: bool, include_usage: bool)");
        return NULL;
    }
    int keep_ids = PyObject_IsTrue(args[1]);
    int include_usage = PyObject_IsTrue(args[2]);
    if (keep_ids < 0 || include_usage < 0) {
        return NULL;
    }
    PyObject *data = args[0];
    const char *s = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    /* A read ending in a blank line and nothing after it (an odd newline more is a line). */
    if (n < 2 || s[n - 1] != '\n' || s[n - 2] != '\n' || (n >= 3 && s[n - 3] == '\n')) {
        Py_RETURN_NONE;
    }
    Event stack[STACK_EVENTS];
    Event *events = stack;
    Py_ssize_t room = STACK_EVENTS;
    long choice, tokens, prompt_tokens;
    Py_ssize_t count = scan_read(s, n, include_usage, &events, &room, &choice, &tokens,
                                 &prompt_tokens);
    PyObject *result = NULL;
    if (count > 0) {
        PyObject *payload = keep_ids ? Py_NewRef(data) : cut(s, events, count);
        if (payload != NULL) {
            result = Py_BuildValue("(Nllln)", payload, choice, tokens, prompt_tokens, count);
        }
    }
    else if (count == 0) {
        result = Py_NewRef(Py_None);
    }
    if (events != stack) {
        PyMem_Free(events);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"scan_ids", (PyCFunction)(void (*)(void))scan_ids, METH_FASTCALL,
     "scan_ids(data, keep_ids, include_usage): see kvtax.delivery.eventscan.scan_ids_py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvtax.delivery._eventscan",
    .m_doc = "The relay's common read in C: kvtax.delivery.eventscan.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__eventscan(void)
{
    return PyModule_Create(&module);
}
