"""Django settings for every test module that runs Django (configured once per process).

A plain module, not a conftest: Django reads its settings once, so test_django.py and
test_principals.py must configure it the same way, whichever pytest imports first. Each
module names its own URLs with ``override_settings(ROOT_URLCONF=...)``. The database is an
in-memory SQLite one (per thread), for ``django.contrib.auth``'s users and sessions.
"""

from __future__ import annotations

import django
from django.conf import settings

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="test-only",
        ALLOWED_HOSTS=["testserver"],
        ROOT_URLCONF="django_setup",
        INSTALLED_APPS=[
            "django.contrib.contenttypes",
            "django.contrib.auth",
            "django.contrib.sessions",
            "rest_framework",
        ],
        MIDDLEWARE=["idempo.contrib.django.IdempotencyMiddleware"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],  # fast, tests only
        USE_TZ=True,
        IDEMPO={"STORE": "memory://"},
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "DEFAULT_PERMISSION_CLASSES": [],
            "UNAUTHENTICATED_USER": None,
        },
    )
    django.setup()

urlpatterns: list[object] = []
