/* Chained page keys in one call: key_i = SHA-256(key_{i-1} || page_i), key_{-1} = root.
 *
 * The whole chain runs in C on OpenSSL's libcrypto (which picks SHA-NI / AVX2 / NEON code for
 * the CPU itself), so the per-page cost is the compression function and not the ~0.4 us of a
 * Python-level hash call. chain_sha256 returns the n 32-byte keys concatenated, keys_sha256
 * as a list of n bytes objects (what kvtier.keys.PageKeyer.keys returns). */

#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <string.h>
#include <openssl/opensslv.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/sha.h>

/* SHA256_Init/Update/Final (deprecated in OpenSSL 3 but kept) skip the provider dispatch of
 * EVP_DigestInit_ex: about 20% less time per 256-byte page. EVP where they are compiled out,
 * or with -DKVTIER_KEYS_EVP. */
#if defined(OPENSSL_NO_DEPRECATED_3_0) || defined(KVTIER_KEYS_EVP)
#define USE_EVP 1
#define BACKEND "EVP"
#else
#define USE_EVP 0
#define BACKEND "SHA256_Init/Update/Final"
#endif

#define KEY_BYTES 32
/* Below this many input bytes the GIL is kept (releasing it costs more than hashing). */
#define NOGIL_BYTES (64 * 1024)

static const EVP_MD *sha256_md = NULL;

/* Hash n pages of data into out; returns 0 on success, -1 if libcrypto failed. */
#if USE_EVP
static int
chain(const EVP_MD *md, const unsigned char *root, const unsigned char *data,
      Py_ssize_t n, Py_ssize_t page_bytes, unsigned char *out)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    const unsigned char *prev = root;
    unsigned int len = 0;
    int ok = ctx != NULL;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        unsigned char *key = out + i * KEY_BYTES;
        ok = EVP_DigestInit_ex(ctx, md, NULL)
             && EVP_DigestUpdate(ctx, prev, KEY_BYTES)
             && EVP_DigestUpdate(ctx, data + i * page_bytes, (size_t)page_bytes)
             && EVP_DigestFinal_ex(ctx, key, &len)
             && len == KEY_BYTES;
        prev = key;
    }
    EVP_MD_CTX_free(ctx);
    return ok ? 0 : -1;
}
#else
static int
chain(const EVP_MD *md, const unsigned char *root, const unsigned char *data,
      Py_ssize_t n, Py_ssize_t page_bytes, unsigned char *out)
{
    const unsigned char *prev = root;
    SHA256_CTX c;
    int ok = 1;
    (void)md;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        unsigned char *key = out + i * KEY_BYTES;
        ok = SHA256_Init(&c)
             && SHA256_Update(&c, prev, KEY_BYTES)
             && SHA256_Update(&c, data + i * page_bytes, (size_t)page_bytes)
             && SHA256_Final(key, &c);
        prev = key;
    }
    return ok ? 0 : -1;
}
#endif

/* Parse and check (root, data, page_bytes), hash the chain; returns the concatenated keys
 * (as_list == 0) or a list of 32-byte bytes (as_list != 0). */
static PyObject *
run_chain(PyObject *args, PyObject *kwargs, const char *format, int as_list)
{
    static char *kwlist[] = {"root", "data", "page_bytes", NULL};
    PyObject *root_obj, *data_obj, *result = NULL, *joined = NULL;
    Py_ssize_t page_bytes, n;
    Py_buffer data = {0};
    unsigned char root[KEY_BYTES], *out;
    int rc;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, kwlist, &root_obj, &data_obj,
                                     &page_bytes))
        return NULL;
    if (!PyBytes_Check(root_obj)) {
        PyErr_Format(PyExc_TypeError, "root must be bytes (a %d-byte key), got %.100s",
                     KEY_BYTES, Py_TYPE(root_obj)->tp_name);
        return NULL;
    }
    if (PyBytes_GET_SIZE(root_obj) != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "root must be a %d-byte key, got %zd bytes", KEY_BYTES,
                     PyBytes_GET_SIZE(root_obj));
        return NULL;
    }
    memcpy(root, PyBytes_AS_STRING(root_obj), KEY_BYTES);
    if (page_bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "page_bytes must be > 0, got %zd", page_bytes);
        return NULL;
    }
    if (PyUnicode_Check(data_obj)) {
        PyErr_SetString(PyExc_TypeError, "data must be a bytes-like object, got str");
        return NULL;
    }
    if (PyObject_GetBuffer(data_obj, &data, PyBUF_C_CONTIGUOUS) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError)
            || PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "data must be a C-contiguous bytes-like object, got %.100s",
                         Py_TYPE(data_obj)->tp_name);
        }
        return NULL;
    }
    if (data.len % page_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "data length %zd is not a multiple of page_bytes %zd",
                     data.len, page_bytes);
        goto done;
    }
    n = data.len / page_bytes;
    joined = PyBytes_FromStringAndSize(NULL, n * KEY_BYTES);
    if (joined == NULL)
        goto done;
    out = (unsigned char *)PyBytes_AS_STRING(joined);
    if (data.len >= NOGIL_BYTES) {
        /* data stays exported (a bytearray cannot be resized meanwhile); joined is not shared */
        Py_BEGIN_ALLOW_THREADS
        rc = chain(sha256_md, root, data.buf, n, page_bytes, out);
        Py_END_ALLOW_THREADS
    } else {
        rc = chain(sha256_md, root, data.buf, n, page_bytes, out);
    }
    if (rc != 0) {
        PyErr_SetString(PyExc_RuntimeError, "libcrypto SHA-256 failed");
        goto done;
    }
    if (!as_list) {
        result = joined;
        joined = NULL;
        goto done;
    }
    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)out + i * KEY_BYTES, KEY_BYTES);
        if (key == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, key);
    }
done:
    Py_XDECREF(joined);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *
chain_sha256(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return run_chain(args, kwargs, "OOn:chain_sha256", 0);
}

static PyObject *
keys_sha256(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return run_chain(args, kwargs, "OOn:keys_sha256", 1);
}

static PyMethodDef methods[] = {
    {"chain_sha256", (PyCFunction)(void (*)(void))chain_sha256, METH_VARARGS | METH_KEYWORDS,
     "chain_sha256(root, data, page_bytes) -> bytes\n\n"
     "The n = len(data) // page_bytes chained SHA-256 keys, concatenated (32 * n bytes):\n"
     "key_i = SHA-256(key_{i-1} || data[i*page_bytes:(i+1)*page_bytes]), key_{-1} = root.\n"
     "root: 32 bytes; data: a C-contiguous buffer whose length is a multiple of page_bytes."},
    {"keys_sha256", (PyCFunction)(void (*)(void))keys_sha256, METH_VARARGS | METH_KEYWORDS,
     "keys_sha256(root, data, page_bytes) -> list[bytes]\n\n"
     "The same keys as chain_sha256, as a list of n 32-byte bytes objects."},
    {NULL, NULL, 0, NULL},
};

static int
exec_module(PyObject *m)
{
#if USE_EVP
    if (sha256_md == NULL) {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
        /* fetched once: EVP_sha256() would be looked up again on every init */
        sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
        sha256_md = EVP_sha256();
#endif
        if (sha256_md == NULL) {
            PyErr_SetString(PyExc_ImportError, "libcrypto has no SHA-256");
            return -1;
        }
    }
#endif
    if (PyModule_AddStringConstant(m, "BACKEND", BACKEND) < 0)
        return -1;
    if (PyModule_AddStringConstant(m, "OPENSSL_VERSION", OpenSSL_version(OPENSSL_VERSION)) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chain",
    "Chained page keys (kvtier's key_i = H(key_{i-1} || page_i)) in one native call.",
    0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    module.m_slots = slots;
    return PyModuleDef_Init(&module);
}
