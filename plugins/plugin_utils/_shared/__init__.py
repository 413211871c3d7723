# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the task worker and the shared multiplexer both use.

The frames between them, the config a worker sends, and what they assume about ansible-core. Standard library
only.
"""
