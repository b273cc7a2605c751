/* kvtax.delivery._eventscan: scan_ids and scan_usage in C, one native call per read.
 *
 * The same functions as kvtax.delivery.eventscan.scan_ids_py and scan_usage_py, whose
 * docstrings say what they do; each pair must answer alike for every input
 * (tests/unit/test_eventscan.py holds them to it). This one exists for what it spares: the line reader makes several Python objects per
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

/* vLLM's usage object, the event's last key (the regular expression VLLM_USAGE in Python). */
static const char USAGE_KEY[] = ",\"usage\":{";
static const char USAGE_PROMPT[] = ",\"usage\":{\"prompt_tokens\":";
static const char USAGE_TOTAL[] = ",\"total_tokens\":";
static const char USAGE_COMPLETION[] = ",\"completion_tokens\":";
static const char USAGE_DETAILS[] = ",\"prompt_tokens_details\":";
static const char USAGE_NULL[] = "null";
static const char USAGE_CACHED[] = "{\"cached_tokens\":";

/* A choice index longer than this is no vLLM's: the line reader takes it (as in Python). */
#define MAX_INDEX_DIGITS 9
/* A token count longer than this does not fit a long long: the line reader takes it. */
#define MAX_COUNT_DIGITS 18
/* Events of one read kept on the stack; a read with more grows a heap array. */
#define STACK_EVENTS 16

/* Where one event's cuts go, as offsets into the read. */
typedef struct {
    Py_ssize_t begin, end;          /* the event, without its blank line */
    Py_ssize_t prompt, closed;      /* the prompt's ids list: '[' ... ']' (prompt < 0: none) */
    Py_ssize_t ids, stop;           /* the choice's ids list; for usage, the usage object */
} Event;

/* What one event counts: its choice, its tokens, its prompt tokens (-1: none). */
typedef struct {
    long long choice, tokens, prompt;
} Counts;

/* One event s[b:e] of a scan's shape: its cuts in *ev and its counts in *c; 0 if it is not of
 * the shape. `flag` is the scan's include_usage. */
typedef int (*EventScan)(const char *s, Py_ssize_t b, Py_ssize_t e, int flag, Event *ev,
                         Counts *c);

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
choices_index(const char *s, Py_ssize_t from, Py_ssize_t to, long long *choice,
              Py_ssize_t *after)
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
        long long value = 0;
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

/* s[b:e] starts a data line of a JSON event. */
static int
is_data(const char *s, Py_ssize_t b, Py_ssize_t e)
{
    return (e - b >= LEN(DATA_SPACED) && memcmp(s + b, DATA_SPACED, LEN(DATA_SPACED)) == 0)
           || (e - b >= LEN(DATA_BARE) && memcmp(s + b, DATA_BARE, LEN(DATA_BARE)) == 0);
}

/* One event s[b:e] of the token_ids shape: its cuts in *ev, its choice, tokens and prompt ids
 * (-1: none). Returns 0 if it is not of the shape (the line reader takes the read). */
static int
scan_event(const char *s, Py_ssize_t b, Py_ssize_t e, int include_usage, Event *ev, Counts *c)
{
    long long *choice = &c->choice;
    if (!is_data(s, b, e)) {
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
    c->prompt = -1;
    if (prompt >= 0) {
        closed = find_byte(s, prompt, e, ']');
        if (closed > ids) {
            return 0;  /* the prompt's list does not close before the choice's ids */
        }
        c->prompt = count_ids(s, prompt + LEN(PROMPT_IDS), closed);
    }
    c->tokens = count_ids(s, ids + LEN(IDS), stop);
    ev->begin = b;
    ev->end = e;
    ev->prompt = prompt;
    ev->closed = closed;
    ev->ids = ids;
    ev->stop = stop;
    return 1;
}

/* `lit` at s[*p:to]: 1 and *p past it, or 0. */
static int
literal(const char *s, Py_ssize_t *p, Py_ssize_t to, const char *lit, Py_ssize_t m)
{
    if (to - *p < m || memcmp(s + *p, lit, (size_t)m) != 0) {
        return 0;
    }
    *p += m;
    return 1;
}

/* The digits at s[*p:to] (at least one), *p past them, their value in *value when it is not
 * NULL. 0 when there are none, or (with a value asked for) more than MAX_COUNT_DIGITS. */
static int
number(const char *s, Py_ssize_t *p, Py_ssize_t to, long long *value)
{
    Py_ssize_t start = *p;
    long long v = 0;
    while (*p < to && s[*p] >= '0' && s[*p] <= '9') {
        if (value != NULL) {
            if (*p - start >= MAX_COUNT_DIGITS) {
                return 0;
            }
            v = v * 10 + (s[*p] - '0');
        }
        (*p)++;
    }
    if (*p == start) {
        return 0;
    }
    if (value != NULL) {
        *value = v;
    }
    return 1;
}

/* VLLM_USAGE matched at s[p:to]: where the match ends, or -1. The optional details group, when
 * present but not whole, leaves a ',' where the closing brace must be: no match, as in the
 * regular expression. */
static Py_ssize_t
vllm_usage(const char *s, Py_ssize_t p, Py_ssize_t to, Counts *c)
{
    if (!literal(s, &p, to, USAGE_PROMPT, LEN(USAGE_PROMPT)) || !number(s, &p, to, &c->prompt)
        || !literal(s, &p, to, USAGE_TOTAL, LEN(USAGE_TOTAL)) || !number(s, &p, to, NULL)
        || !literal(s, &p, to, USAGE_COMPLETION, LEN(USAGE_COMPLETION))
        || !number(s, &p, to, &c->tokens)) {
        return -1;
    }
    Py_ssize_t q = p;
    if (literal(s, &q, to, USAGE_DETAILS, LEN(USAGE_DETAILS))) {
        if (literal(s, &q, to, USAGE_NULL, LEN(USAGE_NULL))) {
            p = q;
        }
        else if (literal(s, &q, to, USAGE_CACHED, LEN(USAGE_CACHED)) && number(s, &q, to, NULL)
                 && q < to && s[q] == '}') {
            p = q + 1;
        }
    }
    return p < to && s[p] == '}' ? p + 1 : -1;
}

/* One event s[b:e] of the usage shape: the usage object's place in *ev (ids: where it starts),
 * its choice, completion tokens and prompt tokens in *c. 0 if it is not of the shape. */
static int
scan_usage_event(const char *s, Py_ssize_t b, Py_ssize_t e, int include_usage, Event *ev,
                 Counts *c)
{
    if (!is_data(s, b, e)) {
        return 0;
    }
    Py_ssize_t end = e - 1;  /* the event's closing brace */
    Py_ssize_t start = rfind(s, b, end, USAGE_KEY, LEN(USAGE_KEY));
    if (start < 0 || vllm_usage(s, start, e, c) != end) {
        return 0;
    }
    Py_ssize_t after;
    if (choices_index(s, b, start, &c->choice, &after) != 1) {
        return 0;  /* the usage-only chunk, or choices in another shape */
    }
    if (!include_usage && find(s, after, start, TERMINAL, LEN(TERMINAL)) >= 0) {
        return 0;  /* a terminal chunk the fingerprint goes on */
    }
    ev->begin = b;
    ev->end = e;
    ev->ids = start;
    return 1;
}

/* The client's bytes of a usage read: each event without its usage object, and its blank
 * line. */
static PyObject *
cut_usage(const char *s, const Event *events, Py_ssize_t count)
{
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        size += events[i].ids - events[i].begin + 3;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) {
        return NULL;
    }
    char *w = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        const Event *ev = &events[i];
        memcpy(w, s + ev->begin, (size_t)(ev->ids - ev->begin));
        w += ev->ids - ev->begin;
        *w++ = s[ev->end - 1];
        *w++ = '\n';
        *w++ = '\n';
    }
    return out;
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

/* Every event of the read s[0:n], each ending at its blank line and read by `one`, into
 * *events (grown on the heap past STACK_EVENTS), the read's counts in *read: its choice, the
 * most prompt tokens, and the tokens summed (`sum`) or the last event's. Returns the number of
 * events, 0 if the read is not all events of the shape and of one choice, -1 on a memory
 * error. */
static Py_ssize_t
scan_read(const char *s, Py_ssize_t n, EventScan one, int flag, int sum, Event **events,
          Py_ssize_t *room, Counts *read)
{
    Py_ssize_t count = 0;
    read->choice = -1;
    read->tokens = 0;
    read->prompt = -1;
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
        Counts c;
        if (!one(s, b, e, flag, &(*events)[count], &c)) {
            return 0;
        }
        if (read->choice >= 0 && c.choice != read->choice) {
            return 0;  /* another choice's event: the line reader keeps their order */
        }
        read->choice = c.choice;
        read->tokens = sum ? read->tokens + c.tokens : c.tokens;
        if (c.prompt > read->prompt) {
            read->prompt = c.prompt;
        }
        count++;
        b = e + 2;
    }
    return count;
}

/* scan_ids and scan_usage: (data, keep, include_usage), by the event scanner `one`. */
static PyObject *
scan(PyObject *const *args, Py_ssize_t nargs, const char *usage, EventScan one, int sum,
     PyObject *(*cut_read)(const char *, const Event *, Py_ssize_t))
{
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    int keep = PyObject_IsTrue(args[1]);
    int include_usage = PyObject_IsTrue(args[2]);
    if (keep < 0 || include_usage < 0) {
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
    Counts read;
    Py_ssize_t count = scan_read(s, n, one, include_usage, sum, &events, &room, &read);
    PyObject *result = NULL;
    if (count > 0) {
        PyObject *payload = keep ? Py_NewRef(data) : cut_read(s, events, count);
        if (payload != NULL) {
            result = Py_BuildValue("(NLLLn)", payload, read.choice, read.tokens, read.prompt,
                                   count);
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

static PyObject *
scan_ids(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    return scan(args, nargs, "scan_ids(data: bytes, keep_ids: bool, include_usage: bool)",
                scan_event, 1, cut);
}

static PyObject *
scan_usage(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    return scan(args, nargs, "scan_usage(data: bytes, keep: bool, include_usage: bool)",
                scan_usage_event, 0, cut_usage);
}

static PyMethodDef methods[] = {
    {"scan_ids", (PyCFunction)(void (*)(void))scan_ids, METH_FASTCALL,
     "scan_ids(data, keep_ids, include_usage): see kvtax.delivery.eventscan.scan_ids_py."},
    {"scan_usage", (PyCFunction)(void (*)(void))scan_usage, METH_FASTCALL,
     "scan_usage(data, keep, include_usage): see kvtax.delivery.eventscan.scan_usage_py."},
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
