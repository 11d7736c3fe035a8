/*
 * Inert definitions of the three Python C-API functions UCCL 0.1.1's
 * libuccl_p2p.so references (it is built for its Python module, which runs inside
 * a Python interpreter). nixl-uccl loads this object into the global namespace
 * before libuccl_p2p.so, and only when the process has no Python runtime, so the
 * library's references resolve. nixl-uccl creates engines with in_python = false,
 * so UCCL does not call them; if it did, they would do nothing, as there is no
 * interpreter whose lock or signals there are.
 */

/* PyGILState_STATE is an enum: PyGILState_LOCKED = 0, PyGILState_UNLOCKED = 1. */
int PyGILState_Ensure(void) { return 1; }
void PyGILState_Release(int state) { (void)state; }
/* 0: no signal handler raised an exception. */
int PyErr_CheckSignals(void) { return 0; }
