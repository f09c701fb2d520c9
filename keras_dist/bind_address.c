/* Makes every TCP listener of a process bind to one address instead of all interfaces.
 *
 * TensorFlow's gRPC server (MultiWorkerMirroredStrategy, tf.distribute.Server) hard-codes
 * a wildcard listen address and runs any graph a client sends, without authentication;
 * torch's TCPStore listens on every interface too. keras_dist preloads this library
 * (LD_PRELOAD) into a cluster's processes so they listen on the cluster's address only:
 * loopback for a cluster on this machine, the address the other machines reach otherwise.
 * See keras_dist/launchers/binding.py, which builds the environment below.
 *
 * Environment, read once when the library loads:
 *   KERAS_DIST_BIND_ADDRESS  IPv4 address that replaces a wildcard (e.g. 127.0.0.1);
 *                            unset or not an IPv4 address: the library changes nothing.
 *   KERAS_DIST_BIND_ALL      set to 1: the library changes nothing (the user's opt-out).
 *
 * A stream socket's bind to 0.0.0.0 goes to that address; a bind to [::] goes to its
 * IPv4-mapped form on a dual-stack socket (IPv4 clients still connect, as they would to
 * the wildcard) and to [::1] on an IPv6-only one. Datagram sockets are left alone: their
 * wildcard binds are mostly clients that send to other machines.
 * Plain C with no Python symbols: Python never imports it.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_function)(int, const struct sockaddr *, socklen_t);

static struct in_addr bound_v4;
static char active_text[INET_ADDRSTRLEN];
/* NULL while inactive. keras_dist reads it to learn that the library is loaded and which
 * address it applies. */
static const char *active_address;

const char *keras_dist_bind_address(void) { return active_address; }

__attribute__((constructor)) static void load_settings(void) {
    const char *address = getenv("KERAS_DIST_BIND_ADDRESS");
    const char *bind_all = getenv("KERAS_DIST_BIND_ALL");
    if (address && inet_pton(AF_INET, address, &bound_v4) == 1 && !(bind_all && strcmp(bind_all, "1") == 0))
        active_address = inet_ntop(AF_INET, &bound_v4, active_text, sizeof active_text);
}

static int next_bind(int fd, const struct sockaddr *address, socklen_t length) {
    /* Resolved on first use: a library's constructor may bind before ours has run. */
    static bind_function libc_bind;
    if (!libc_bind)
        libc_bind = (bind_function)dlsym(RTLD_NEXT, "bind");
    return libc_bind(fd, address, length);
}

static int is_stream_socket(int fd) {
    int type = 0;
    socklen_t size = sizeof type;
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) == 0 && type == SOCK_STREAM;
}

int bind(int fd, const struct sockaddr *address, socklen_t length) {
    if (!active_address || !address || !is_stream_socket(fd))
        return next_bind(fd, address, length);
    if (address->sa_family == AF_INET && length >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in v4;
        memcpy(&v4, address, sizeof v4);
        if (v4.sin_addr.s_addr == htonl(INADDR_ANY)) {
            v4.sin_addr = bound_v4;
            return next_bind(fd, (const struct sockaddr *)&v4, sizeof v4);
        }
    } else if (address->sa_family == AF_INET6 && length >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 v6;
        memcpy(&v6, address, sizeof v6);
        if (IN6_IS_ADDR_UNSPECIFIED(&v6.sin6_addr)) {
            int v6_only = 0;
            socklen_t size = sizeof v6_only;
            getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6_only, &size);
            if (v6_only) {
                v6.sin6_addr = in6addr_loopback;
            } else {  /* ::ffff:a.b.c.d */
                memset(v6.sin6_addr.s6_addr, 0, 10);
                memset(v6.sin6_addr.s6_addr + 10, 0xff, 2);
                memcpy(v6.sin6_addr.s6_addr + 12, &bound_v4, 4);
            }
            return next_bind(fd, (const struct sockaddr *)&v6, sizeof v6);
        }
    }
    return next_bind(fd, address, length);
}
