"""The settings of the example project: one MongoDB database through django-mongodb-backend."""

from __future__ import annotations

import os

DATABASES = {
    "default": {
        "ENGINE": "django_mongodb_backend",
        "HOST": os.environ.get("MONGODB_URI", "mongodb://127.0.0.1:27017/?directConnection=true"),
        "NAME": os.environ.get("DJANGO_SHOP_DB", "django_shop"),
    },
}
INSTALLED_APPS = ["shop"]
# Every model's primary key is an ObjectId, as MongoDB's own _id.
DEFAULT_AUTO_FIELD = "django_mongodb_backend.fields.ObjectIdAutoField"
MIGRATION_MODULES = {"shop": "shop.migrations"}
USE_TZ = True
SECRET_KEY = "not-a-secret: the example serves no web page"
